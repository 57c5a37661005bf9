"""The open-loop driver: planned send times hold however long requests take."""

import asyncio
import io

from loadgen.records import OK, Arrival, Record
from loadgen.loops import Progress, run_open_loop


def test_requests_leave_on_schedule_while_earlier_ones_run():
    arrivals = [Arrival(0.02 * i, "p") for i in range(40)]  # 0.8 s of arrivals
    in_flight, peak = 0, 0

    async def slow_send(index, arrival, start):
        nonlocal in_flight, peak
        loop = asyncio.get_running_loop()
        record = Record(index=index, planned_s=arrival.time_s, sent_s=loop.time() - start)
        in_flight += 1
        peak = max(peak, in_flight)
        await asyncio.sleep(0.5)  # each request takes far longer than the gap between arrivals
        in_flight -= 1
        record.status, record.latency_s = OK, loop.time() - start - record.sent_s
        return record

    async def main():
        loop = asyncio.get_running_loop()
        start = loop.time()
        records = await run_open_loop(arrivals, slow_send, Progress(len(arrivals), stream=stream))
        return records, loop.time() - start

    stream = io.StringIO()
    records, wall = asyncio.run(main())
    assert [r.index for r in records] == list(range(40))
    lags = [r.sent_s - r.planned_s for r in records]
    assert min(lags) >= 0 and max(lags) < 0.1  # absolute schedule: no drift over the run
    assert peak >= 20 and wall < 0.78 + 0.5 + 0.3  # open loop: sends never waited for answers
    shown = stream.getvalue()
    assert shown.endswith("\n") and "sent 40/40  completed 40  refused 0  errors 0  in flight 0" in shown


def test_progress_line_counts_and_rate():
    progress = Progress(total=10, label="rate 5/s ", stream=io.StringIO(), window_s=2.0)
    for t in (0.1, 0.5, 2.9, 3.0):
        progress.on_sent(t)
    progress.on_done(Record(index=0, planned_s=0, sent_s=0, status=OK))
    progress.on_done(Record(index=1, planned_s=0, sent_s=0, status="refused"))
    line = progress.line(3.0)
    assert line.startswith("rate 5/s ") and "sent 4/10  completed 1  refused 1  errors 0  in flight 2" in line
    assert line.endswith("rate 1.0/s")  # two sends in the last 2 s


def test_a_chats_next_turn_waits_for_its_previous_answer_and_carries_the_chat():
    arrivals = [Arrival(0.0, "a"), Arrival(0.01, "b"), Arrival(0.02, "c", after=0), Arrival(0.03, "d", after=2)]
    sent = {}

    async def send(index, arrival, start):
        loop = asyncio.get_running_loop()
        sent[index] = (loop.time() - start, arrival)
        await asyncio.sleep(0.3 if index == 0 else 0.05)  # the first turn takes long
        return Record(index=index, planned_s=arrival.time_s, sent_s=sent[index][0], status=OK,
                      latency_s=loop.time() - start - sent[index][0], text=f"<{arrival.prompt}>")

    records = asyncio.run(run_open_loop(arrivals, send))
    assert [r.index for r in records] == [0, 1, 2, 3]
    assert sent[1][0] < 0.2 and sent[2][0] >= records[0].end_s  # b on time; c after a's answer
    assert sent[2][1].history == ("a", "<a>") and sent[2][1].text == "a<a>c"
    assert sent[3][1].history == ("a", "<a>", "c", "<c>") and sent[3][0] >= records[2].end_s
