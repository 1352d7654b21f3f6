"""A plain-Python LRU with the brief's exact semantics: the oracle for ess.core.policy.lru_update."""


class OracleLRU:
    def __init__(self, capacity: int):
        self.capacity = capacity
        self.stamp: dict[int, int] = {}  # resident position -> last-use stamp

    def step(self, topk, own, t: int) -> int:
        """One step (own = -1: a warm-up window; a list: several own tokens, as in MTP verify). Returns the misses."""
        owns = {o for o in (own if isinstance(own, (list, tuple)) else [own]) if o >= 0}
        s = {p for p in topk if p >= 0 and p not in owns}
        misses = s - self.stamp.keys()
        new = len(misses) + len(owns - self.stamp.keys())
        excess = len(self.stamp) + new - self.capacity
        if excess > 0:
            victims = sorted((self.stamp[p], p) for p in self.stamp if p not in s and p not in owns)
            for _, p in victims[:excess]:
                del self.stamp[p]
        for p in s | owns:
            self.stamp[p] = t
        return len(misses)
