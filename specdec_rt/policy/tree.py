"""When a draft tree pays: its extra nodes against what they cost in the verify call.

A request alone may draft its main chain (k tokens) plus up to ``n`` other nodes (the draft's
most probable alternatives to the chain's tokens). In units of one plain target step, a round costs
``R = k d + v(k)`` and yields ``T = E(a, k)`` tokens (``v``: the verify cost of the cost model;
``d``: of one draft step). ``n`` extra nodes cost ``v(k + n) - v(k) = n s`` more and yield
``n h`` more tokens, ``h`` being how often an offered node ends up on the accepted path. They pay
when ``(T + n h) / (R + n s) > T / R``, i.e. when ``h > s T / R = s x (the round's speedup)``.
The scheduler compares the chain with the tree over each depth j <= k of its main chain
(``_tree_shape``): where drafts deep in the chain are seldom right and nodes often are, a
shorter chain plus its nodes yields more per step than the whole chain under them.

``h`` is an EWMA per request (prior ``TREE_PRIOR``). While trees do not pay the request drafts
chains and offers a tree again every ``TREE_PROBE_EVERY`` rounds, so the estimate can recover.
What happened is counted in the request's ``Stats`` (``tree_nodes``, ``tree_hits``).

That rule sees the verify call only. A tree also makes longer accepted paths, hence longer
drafts, and its walk and compaction cost a little host time; where drafting bounds the round
(SmolLM2's int8 draft costs ~0.45 of a target step) trees measured 4% slower with the rule
satisfied. So the scheduler also keeps ``TreeRates``: the realized tokens per second of tree
rounds and of chain rounds (EWMAs shared by its requests; each mode is probed every
``TREE_PROBE_EVERY`` rounds), and trees stay on only while their rounds are not slower. Seeded
requests skip the realized rates (timings would make their output depend on the machine).
"""

from __future__ import annotations

__all__ = ["TreePolicy", "TreeRates", "TREE_PRIOR", "TREE_PROBE_EVERY"]

TREE_PRIOR = 0.3  # hits per offered node before any was observed
TREE_PROBE_EVERY = 16  # rounds between trees while they do not pay


class TreePolicy:
    """Per request: how many tree nodes to offer this round (0: a chain)."""

    def __init__(self, nodes: int, alpha: float) -> None:
        self.max_nodes = nodes
        self.alpha = alpha
        self.hit_rate = TREE_PRIOR
        self._since_probe = 0

    def nodes(self, alone: bool, model_pays: bool, rates: "TreeRates | None" = None) -> int:
        """Nodes to offer: ``alone`` (trees go in a call of their own), ``model_pays``: the cost
        model rates a tree round above the chain (the rule above, over the tree's best depth);
        ``rates``: the realized speeds of both kinds of round, which decide once both were
        measured."""
        if not self.max_nodes or not alone:
            return 0
        realized = rates.pays() if rates is not None else None
        pays = model_pays if realized is None else realized
        clock = rates if rates is not None else self  # shared: short requests still probe
        clock._since_probe += 1
        if clock._since_probe >= TREE_PROBE_EVERY:  # the other kind of round, now and then
            clock._since_probe = 0
            pays = not pays
        return self.max_nodes if pays else 0

    def observe(self, offered: int, hit: bool) -> None:
        """A round that offered ``offered`` nodes beyond the main chain; ``hit``: one of them was
        accepted."""
        if offered <= 0:
            return
        self.hit_rate += self.alpha * (float(hit) / offered - self.hit_rate)


class TreeRates:
    """Realized tokens per second of tree rounds and of chain rounds (EWMAs; shared)."""

    def __init__(self, alpha: float) -> None:
        self.alpha = alpha
        self.tree: float | None = None
        self.chain: float | None = None
        self._count = {True: 0, False: 0}  # rounds measured of each kind
        self._since_probe = 0  # rounds of all requests since the other kind was tried

    def observe(self, tree: bool, tokens: int, seconds: float) -> None:
        """One round's realized rate. Each kind's estimate is the mean of its rounds until there
        are ``1 / alpha`` of them, an EWMA after: the kind in use is measured every round, the
        other only by probes (every ``TREE_PROBE_EVERY`` rounds), and a plain EWMA kept that
        one's first, often cold, round for ~10 probes (SmolLM2's chains read ~40 tok/s against
        ~55 measured by a chain-only scheduler beside it, so trees stayed on while slower)."""
        if seconds <= 0:
            return
        rate = tokens / seconds
        self._count[tree] += 1
        old = self.tree if tree else self.chain
        new = rate if old is None else old + max(self.alpha, 1.0 / self._count[tree]) * (rate - old)
        if tree:
            self.tree = new
        else:
            self.chain = new

    def pays(self) -> bool | None:
        """Whether tree rounds are not slower (None until both kinds were measured)."""
        if self.tree is None or self.chain is None:
            return None
        return self.tree >= self.chain
