"""How ``logprobs`` show a token (``cluster.protocol``): its text, and in a chat its bytes."""

from cluster import protocol


def test_a_chat_logprob_shows_a_split_characters_bytes():
    """The token text of a piece of a character is its bytes escaped (U+FFFD would stand
    for any); ``bytes`` are the piece's own, which joined give the character."""
    first, rest = protocol.Piece("\ufffd", "你".encode()[:2]), protocol.Piece("\ufffd", "你".encode()[2:])
    whole = protocol.Piece("你", "你".encode())
    content = protocol.chat_logprobs([protocol.TokenEntry(first, -0.1, ((first, -0.1), (whole, -3.0))),
                                      protocol.TokenEntry(rest, -0.2)])["content"]
    assert [c["token"] for c in content] == ["\\xe4\\xbd", "\\xa0"]
    assert bytes(content[0]["bytes"] + content[1]["bytes"]).decode() == "你"
    assert [t["token"] for t in content[0]["top_logprobs"]] == ["\\xe4\\xbd", "你"]
    completion = protocol.completion_logprobs([protocol.TokenEntry(whole, -0.5, ((whole, -0.5),))], 3)
    assert completion == {"tokens": ["你"], "token_logprobs": [-0.5], "top_logprobs": [{"你": -0.5}], "text_offset": [3]}
