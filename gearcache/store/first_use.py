"""``FirstUse``: the first use of a cache folder: created (never re-created once it vanished), trusted, cleaned up."""
from __future__ import annotations

import errno
from typing import Callable

from .layout import Layout
from .trust import Trust


class FirstUse:
    """The first-use checks of one cache folder, run once: create the root and its main folders with the folder's
    mode, refuse an untrusted root (``UntrustedCacheError``), then run ``on_first_use`` (the Store sets it to its
    ``Maintenance.cleanup``).

    ``on_first_use`` is dropped once it ran: the maintenance refers back to this part (it evicts only after the
    first-use checks), a reference cycle that lasts only until the folder's first use. From then on a Store and its
    parts are freed as soon as the last reference to them goes (``Leases`` releases its leases then), whichever part
    a caller kept."""

    def __init__(self, layout: Layout, trust: Trust, on_first_use: Callable[[], object] | None = None):
        self.layout, self.trust = layout, trust
        self.on_first_use: Callable[[], object] | None = on_first_use
        self.checked = False
        self._seen = False      # an entry was read from it: if it is gone later, it vanished (never recreate it)

    def seen(self) -> None:
        """An entry was read from the folder: from now on, its disappearance is an error, not a first use."""
        self._seen = True

    def ensure(self) -> None:
        """Run the first-use checks once. Raises ``OSError`` (``UntrustedCacheError`` included)."""
        if self.checked:
            return
        layout = self.layout
        if self._seen and not layout.root.is_dir():
            raise self.vanished()
        layout.root.parent.mkdir(parents=True, exist_ok=True)
        layout.mkdir(layout.root)
        self.trust.check(layout.root)
        for folder in (layout.artifacts, layout.entries, layout.locks, layout.tmp):
            layout.mkdir(folder)
        for folder in (layout.artifacts, layout.entries):
            self.trust.check(folder)
        self.checked = True
        self.trust.root_trusted()
        hook, self.on_first_use = self.on_first_use, None
        if hook is not None:
            hook()

    def vanished(self) -> FileNotFoundError:
        """The error of a cache folder that vanished while this process ran (it is never re-created)."""
        return FileNotFoundError(errno.ENOENT, "the cache folder vanished while this process ran",
                                 str(self.layout.root))
