"""A plain-Python LRU with the brief's exact semantics: the oracle for ess.policy.lru_update."""


class OracleLRU:
    def __init__(self, capacity: int):
        self.capacity = capacity
        self.stamp: dict[int, int] = {}  # resident position -> last-use stamp

    def step(self, topk, own: int, t: int) -> int:
        """One step (own = -1: a warm-up window). Returns the number of misses."""
        s = {p for p in topk if p >= 0 and p != own}
        misses = s - self.stamp.keys()
        new = len(misses) + (1 if own >= 0 and own not in self.stamp else 0)
        excess = len(self.stamp) + new - self.capacity
        if excess > 0:
            victims = sorted((self.stamp[p], p) for p in self.stamp if p not in s and p != own)
            for _, p in victims[:excess]:
                del self.stamp[p]
        for p in s:
            self.stamp[p] = t
        if own >= 0:
            self.stamp[own] = t
        return len(misses)
