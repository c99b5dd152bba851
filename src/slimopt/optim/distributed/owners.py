"""Owner ranks for whole-matrix work under FSDP2: which rank computes each matrix that a step needs whole.

Muon's Newton-Schulz iteration and an SVD refresh need a whole matrix while FSDP2 gives each rank a block of its
rows. Done by every rank (Muon) or by the group's first rank (refreshes), the work is repeated W times or
serialized on one rank; given to one owner rank each, it is done once and spread. This module makes the plan: a
cost for each job, owners by longest-processing-time-first (Graham, "Bounds on multiprocessing timing anomalies",
1969: no rank's load exceeds the mean load plus the largest job), at most ceil(N / W) + 1 jobs a rank (a small
matrix's decomposition costs a call more than its multiply-adds), and buckets of jobs in backward order, so that
a bucket's exchange can start while later ones are still being computed. The plan is a pure function of the job
list, so every rank that lists the same parameters makes the same plan without communicating.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

__all__ = ["Job", "OwnerPlan", "muon_cost", "svd_cost", "randomized_svd_cost", "plan_owners"]


def muon_cost(m: int, n: int, ns_steps: int) -> float:
    """Multiply-adds of Muon's iteration on an m x n matrix: each step forms X X^T (s x s from s x l), its square
    and their product with X, with s = min(m, n), l = max(m, n): ns_steps * s^2 (2 l + s)."""
    s, big = min(m, n), max(m, n)
    return float(ns_steps) * s * s * (2 * big + s)


def svd_cost(m: int, n: int) -> float:
    """About the multiply-adds of a full SVD of an m x n matrix: m n min(m, n)."""
    return float(m) * n * min(m, n)


def randomized_svd_cost(m: int, n: int, k: int, power_iters: int) -> float:
    """Multiply-adds of a randomized range finder with k columns and q power iterations: 2 (q + 1) m n k."""
    return 2.0 * (power_iters + 1) * m * n * k


@dataclass(frozen=True)
class Job:
    """One matrix to compute whole: the parameter's position in the optimizer (its order over the groups), its
    shape, the bytes of its rows as exchanged (rows x cols x element size), and its cost."""

    index: int
    shape: tuple[int, int]
    nbytes: int
    cost: float


@dataclass(frozen=True)
class OwnerPlan:
    """owners[i]: the rank computing jobs[i]; loads[r]: the summed cost of rank r's jobs; buckets: positions into
    jobs, each bucket's jobs exchanged together, the buckets in backward order (the last parameters first)."""

    jobs: tuple[Job, ...]
    world: int
    owners: tuple[int, ...]
    loads: tuple[float, ...]
    buckets: tuple[tuple[int, ...], ...]

    def owned_by(self, rank: int) -> list[int]:
        """Positions of the jobs `rank` computes, in job order."""
        return [i for i, r in enumerate(self.owners) if r == rank]


def plan_owners(jobs: list[Job], world: int, bucket_bytes: int = 64 << 20) -> OwnerPlan:
    """Owners by longest-processing-time-first: jobs by decreasing cost (ties: lower index first), each to the rank
    with the least load so far among those holding fewer than ceil(N / W) + 1 jobs (ties: in turn from rank
    (smallest job index mod world), so that plans of one or a few jobs, as a layer-wise step makes, rotate over
    the ranks instead of all landing on rank 0). Buckets: the jobs by decreasing index, cut where adding the next
    job would pass `bucket_bytes` (at least one job each)."""
    if not isinstance(world, int) or world < 1:
        raise ValueError(f"world must be a positive number of ranks, got {world!r}")
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes!r}")
    indices = [j.index for j in jobs]
    if len(set(indices)) != len(indices):
        raise ValueError("jobs must have distinct parameter indices")
    for j in jobs:
        if not j.cost >= 0 or j.nbytes < 0:  # also refuses a NaN cost
            raise ValueError(f"job of parameter {j.index}: cost and nbytes must be non-negative, got {j.cost!r}, "
                             f"{j.nbytes!r}")
    owners = [0] * len(jobs)
    loads = [0.0] * world
    first = min(indices, default=0) % world
    heap = [(0.0, (r - first) % world, r) for r in range(world)]  # (load, turn, rank): least loaded, then by turn
    heapq.heapify(heap)
    cap = -(-len(jobs) // world) + 1  # jobs a rank: small jobs' fixed costs (a call, a launch) count too
    counts = [0] * world
    for i in sorted(range(len(jobs)), key=lambda i: (-jobs[i].cost, jobs[i].index)):
        full = []
        while True:
            load, turn, rank = heapq.heappop(heap)
            if counts[rank] < cap:
                break
            full.append((load, turn, rank))
        for item in full:
            heapq.heappush(heap, item)
        owners[i] = rank
        counts[rank] += 1
        loads[rank] = load + jobs[i].cost
        heapq.heappush(heap, (loads[rank], turn, rank))
    buckets: list[tuple[int, ...]] = []
    current: list[int] = []
    size = 0
    for i in sorted(range(len(jobs)), key=lambda i: -jobs[i].index):
        if current and size + jobs[i].nbytes > bucket_bytes:
            buckets.append(tuple(current))
            current, size = [], 0
        current.append(i)
        size += jobs[i].nbytes
    if current:
        buckets.append(tuple(current))
    return OwnerPlan(tuple(jobs), world, tuple(owners), tuple(loads), tuple(buckets))
