"""A clock the tests set by hand, injected where the code would read the time (policies, residency managers)."""


class FakeClock:
    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def at(policy, t: float):
    """`policy`, its clock set to `t`: `at(p, 10).accessed("a")` is a call at t = 10."""
    policy.clock.now = t
    return policy
