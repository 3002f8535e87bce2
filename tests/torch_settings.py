"""Context managers that change one torch setting for a block and put it back (tests of keys and state checks)."""
import contextlib


@contextlib.contextmanager
def setting(get, set_, value):
    """``set_(value)`` for the block; ``set_(get())``'s value from before afterwards."""
    before = get()
    set_(value)
    try:
        yield
    finally:
        set_(before)


def attribute(obj, name, value):
    """``obj.name = value`` for the block."""
    return setting(lambda: getattr(obj, name), lambda v: setattr(obj, name, v), value)
