"""The content this process has seen submitted lately: which way a submission goes first.

Content dedup is exact either way (the store's submit inserts or gets the task holding a
dedup key in one transaction); this only picks the cheaper way for the likely answer. A
content key seen lately is probably held by a task, so its submission reads first (a hit
answered from one read, no write); a content key not seen goes straight to the store's
insert-or-get, which answers a hit as well, without a read before it that would miss.
"""

from __future__ import annotations

from collections import OrderedDict

#: How many content keys are kept (least recently seen first out): about 1.7 MB.
RECENT_KEYS = 8192


class RecentContent:
    """A bounded set of (tenant, content key), least recently seen first out.

    An ``OrderedDict``, not a plain dict: taking the oldest key out of a dict walks over
    the slots of the keys taken out before it (until the dict is rebuilt), so at a full
    set every addition cost a walk over thousands of empty slots."""

    def __init__(self, size: int = RECENT_KEYS) -> None:
        self.size = size
        self._keys: OrderedDict[tuple[str, str], None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._keys)

    def seen(self, tenant: str, content: str) -> bool:
        """Whether the content was seen lately (and now is the most recent)."""
        key = (tenant, content)
        if key not in self._keys:
            return False
        self._keys.move_to_end(key)
        return True

    def add(self, tenant: str, content: str) -> None:
        """Remember a content key a task holds now."""
        keys = self._keys
        keys[(tenant, content)] = None
        keys.move_to_end((tenant, content))
        if len(keys) > self.size:
            keys.popitem(last=False)
