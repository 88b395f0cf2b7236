"""The search's last phases: climbing from a candidate by partition moves, and the first
device's W tail.

Sits under :mod:`adaptis.planner.search`, which ranks the structures and policies and hands
its best candidates here with its evaluator (budget, deadline, champion); every trial is one
list schedule (:mod:`adaptis.planner.scheduler`), kept only if the simulated time improves.
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial

from adaptis.planner.costs import Costs
from adaptis.planner.evaluator import Candidate, Evaluator
from adaptis.planner.structures import evenness_of, loads, max_load

__all__ = ["refine", "w_tail"]

# Refinement: non-bottleneck boundary moves tried per round after the bottleneck's own two.
_OTHER_MOVES = 3
# Screened problems: the refinement's full schedules.
_REFINE_SCREENED = 6


def w_tail(costs: Costs, *, best: Candidate, ev: Evaluator) -> Candidate:
    """Stage 0's backward is all W, and W runs last: device 0 can end the iteration with a run
    of deferred W's. Fuse stage 0's backward (BW at once) for its last ``p`` microbatches, then
    for all of them; each kept only if the simulation improves (extra to the budget: two
    schedules). Not on screened problems: there a full schedule is what costs."""
    if ev.screen is not None or not best.policy.split_backward:
        return best
    m = costs.microbatches
    for start in dict.fromkeys((max(0, m - costs.devices), 0)):
        ev.budget += 1
        trial = ev.run(best.pattern, best.owner, stages=best.stages,
                       policy=replace(best.policy, fuse_first_from=start))
        if trial.time < best.time * (1 - 1e-9):
            best = trial
    return best


def refine(costs: Costs, *, best: Candidate, ev: Evaluator) -> Candidate:
    """Partition moves from ``best`` (same placement and policy), each kept only if the
    simulated time improves, until no move helps or ``ev``'s budget is spent (on a screened
    problem: after :data:`_REFINE_SCREENED` of them, each a full schedule)."""
    pre = ev.pre  # the evaluator's prefix sums of the layers' work
    tried: set[tuple[int, ...]] = set()
    if ev.screen is not None:
        ev.budget = min(ev.budget, ev.evals + _REFINE_SCREENED)
    while not ev.spent:
        owner = best.owner
        cuts = [lo for lo, _ in best.stages] + [best.stages[-1][1]]
        load = loads(costs, owner, cuts=cuts, pre=pre)
        hot = max(range(len(load)), key=load.__getitem__)
        moves: list[list[int]] = []
        # Shrink each stage of the bottleneck device by one layer, towards the cooler side.
        for s, d in enumerate(owner):
            if d != hot or cuts[s + 1] - cuts[s] < 2:
                continue
            if s > 0:
                moves.append([*cuts[:s], cuts[s] + 1, *cuts[s + 1:]])
            if s + 1 < len(owner):
                moves.append([*cuts[:s + 1], cuts[s + 1] - 1, *cuts[s + 2:]])
        moves = [mv for mv in moves if tuple(mv) not in tried]
        moves.sort(key=partial(max_load, costs, owner=owner, pre=pre))
        # Then any other boundary one layer either way: the bottleneck of the *schedule* is
        # not always the busiest device (a stage that starts late, a W tail), so the loads'
        # max cannot rank these; the least squared load (most even) goes first.
        others = []
        for i in range(1, len(cuts) - 1):
            for step in (-1, 1):
                k = cuts[i] + step
                if cuts[i - 1] < k < cuts[i + 1]:
                    mv = [*cuts[:i], k, *cuts[i + 1:]]
                    if tuple(mv) not in tried and mv not in moves:
                        others.append(mv)
        others.sort(key=partial(evenness_of, costs, owner=owner, pre=pre))
        moves = moves[:2] + others[:_OTHER_MOVES]
        if not moves:
            break
        improved = False
        for mv in moves:
            if ev.spent:
                break
            tried.add(tuple(mv))
            stages = [(mv[s], mv[s + 1]) for s in range(len(mv) - 1)]
            trial = ev.run(best.pattern, owner, stages=stages, policy=best.policy)
            if trial.time < best.time * (1 - 1e-9):
                best, improved = trial, True
                break
        if not improved:
            break
    return best
