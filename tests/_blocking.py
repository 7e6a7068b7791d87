"""BlockingLayer: a layer index that holds a call inside a cache or a pool (for the tests of
one call at a time)."""


class BlockingLayer(int):
    """A layer index whose conversion sets `inside`, then waits for `go`: the call that
    converts it stays inside the object while another thread tries to use it."""

    def __new__(cls, value, inside, go):
        obj = super().__new__(cls, value)
        obj.inside, obj.go = inside, go
        return obj

    def __int__(self):
        self.inside.set()
        assert self.go.wait(60)
        return super().__int__()

    __index__ = __int__
