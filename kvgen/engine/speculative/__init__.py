"""Speculative decoding: cheap proposals verified by one target pass (see docs/speculative.md).

    proposer.py    what every proposer offers the engine
    ngram.py       prompt lookup: the tokens that followed the last n-gram's latest earlier occurrence
    suffix.py      suffix decoding: a suffix tree over the prompt, the output and recent requests' outputs
    draft.py       a smaller model (or a quantized copy of the target) over the target's block tables
    hybrid.py      a draft model that lets the suffix tree propose where the text repeats
    adaptive.py    when the batch is large enough that speculating stops paying
    speculator.py  the engine's side: who speculates, reserving, proposing, verifying, counters
"""
