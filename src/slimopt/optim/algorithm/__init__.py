"""The algorithm: pure tensor functions of what a step computes, knowing nothing of kernels or ranks.

Update rules (``rules``, Muon's iteration ``muon``, TACO's one-sparse step ``taco``), projectors and their bases
(``projectors``), the storage of moments (``codecs`` over the quantizers of ``quant``), counter-based random streams
(``noise``), the scratch a step may allocate (``budget``), the named methods (``specs``), the parameter partition
(``partition``) and which settings a group reads (``usage``). Nothing here imports ``routes`` or ``distributed``.
"""
