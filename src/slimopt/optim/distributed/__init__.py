"""What a row-sharded (FSDP2) parameter's step adds: a shard is a window of the whole tensor (``sharded.Target``),
and only what spans rows communicates.

Row splits and collectives (``shardcomm``), a factored moment's column sums and the projections' subspaces of a
shard (``sharded``), bases decomposed on one rank (``sharded_bases``), TACO's column max-loc (``sharded_taco``),
Muon's iteration on gathered rows (``muon_sharded``), and the world-size-free checkpoint form that
torch.distributed.checkpoint saves and reshards (``portable``, ``distcheckpoint``).
"""
