"""The engine replica: one model, its paged KV cache, and the FDFO step loop.

Glossary: the shared terms, as the code uses them (``../shared/DESIGN.md`` explains why).

* **block**: ``block_length`` consecutive answer positions that are denoised together and
  committed together; a request's answer is a whole number of blocks.
* **step**: one model forward over the batch, plus the algorithm deciding which masked
  positions of each row's active block it fills. A block takes one or more steps.
* **commit**: a block whose positions are all filled becomes final: its ids are appended
  to the request's output and its KV is written (with the **fused commit**, by the next
  step's forward instead of a forward of its own). A ``BlockCommit`` (``replicas.commits``)
  is what one adds; the scheduler applies it.
* **row**: a request's place in the running batch (``replicas.rows``); a **row-step** is
  one row in one step, the unit of cost in which admission, routing and the autoscaler
  count work.
* **page**: one block of KV in the pool (``replicas.kv_cache``); a request holds pages
  for its prompt, its committed blocks and one for its active block: one
  ``PageAllocation``, which the scheduler gets from the pool at admission (the cached
  pages it shares first, its later blocks' pages promised) and gives back at its end.
* **canvas**: what a row's forward sees: ``block`` (the prompt, committed blocks and the
  active block) or ``full`` (also the masks of every later block: LLaDA's and Dream's own
  generate(), and what infilling needs).
* **aligned blocks** (``block_alignment: prompt``): the first answer block also holds the
  prompt's last ids (its **head**), as SDAR and LLaDA2.0 generate; ``page``: answers start
  on a page of their own.
* **mode**: the batching rule (``replicas.batching``): ``fdfo`` (first done, first out:
  a row leaves the step its request ends and a waiting one takes it) and the research
  baselines ``sync``, ``static``, ``fixed_fill``.
* **fill timeout / hold**: how long a not-full batch may wait for arrivals before it
  steps (``replicas.fill_timeout``).
* **cost**: a request's row-steps as admission charges them (``replicas.request_cost``); the
  **step debt** is a replica's cost of live requests minus the steps they took, and the
  **drain rate** its row-steps per second at full batch: debt / rate is its **predicted
  drain time**, which the router and admission compare with the SLO.
* **step cost**: seconds per step, fitted as c0 + c1 · rows (``replicas.cost_model``).
* **resume**: a request continued on another replica from its committed blocks
  (``SamplingParams.resume_ids``), as if the first one had gone on.
* **ingress / replica messages** (``replicas.messages``): ``GenerateRequest`` in (with
  the engine's ``SamplingParams``), ``GenerateChunk`` out, one per committed block, as the engine emits it.
"""
