"""What Describe tells a client of the server's shards, in pages of a bounded size.

A server may hold a hundred thousand shards, and each may name thousands of classes (ImageNet
packed by ``remoteloader pack`` is hundreds of tars, each naming its 1,000 classes; ImageNet-21k
names 21,843). So class lists travel once, not once per shard: each distinct list is numbered
in the order the shards first name it, and a shard carries its list's number. And shards travel
in pages: each page holds the shards that fit in ``limits.DESCRIBE_PAGE_BYTES`` (at least one)
and the class lists they are the first to name, so that however many shards and classes there
are, no response passes ``limits.MAX_DESCRIBE_BYTES``. A single shard whose class list alone
would is refused when the catalog is made (``DescribeError``), never sent as a message the
client cannot take.

The pages are cut once, when the server starts; a page is built when a client asks for it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from remoteloader.protos import limits, loader_pb2
from remoteloader.server.catalog import Shard

# A Shard message's bytes beside its id, name, fields and class list number (their framing and
# the sample count): an upper bound, so that a page is never larger than it was cut for.
_SHARD_FRAMING = 32


class DescribeError(ValueError):
    """The shards cannot be described within the limits (a shard id, or a class list, too long)."""


class _Page(NamedTuple):
    shard_start: int
    shard_end: int
    list_start: int
    list_end: int


class ShardPages:
    """The server's shards as Describe pages them.

    Args:
        shards: The server's shards, in the order it serves them.

    Raises:
        DescribeError: A shard id longer than ``limits.MAX_SHARD_ID_BYTES``, or a shard whose
            class list alone would make a page larger than ``limits.MAX_DESCRIBE_BYTES``.
    """

    def __init__(self, shards: Sequence[Shard]):
        self.shards = list(shards)
        self.class_lists: list[list[str]] = []  # numbered in the order shards first name them
        self.list_of: list[int] = []  # per shard: 1 + its list's number; 0: no classes
        numbers: dict[int, int] = {}  # id() of a list object -> its number (shards usually share one)
        by_names: dict[tuple[str, ...], int] = {}
        list_bytes: list[int] = []
        for shard in self.shards:
            if len(shard.id.encode()) > limits.MAX_SHARD_ID_BYTES:
                raise DescribeError(
                    f"shard {shard.name}: its id {shard.id!r} is longer than {limits.MAX_SHARD_ID_BYTES} bytes"
                )
            names = shard.class_names
            if not names:
                self.list_of.append(0)
                continue
            number = numbers.get(id(names))
            if number is None:
                key = tuple(names)
                number = by_names.get(key)
                if number is None:
                    number = by_names[key] = len(self.class_lists)
                    self.class_lists.append(list(names))
                    list_bytes.append(loader_pb2.ClassList(names=names).ByteSize() + 5)
                numbers[id(names)] = number
            self.list_of.append(number + 1)
        self._pages = {page.shard_start: page for page in self._cut(list_bytes)}

    def _cut(self, list_bytes: list[int]) -> list[_Page]:
        pages = []
        start = lists = 0  # the page's first shard, and the lists named before it
        size = 0
        seen = 0  # lists named so far
        for i, shard in enumerate(self.shards):
            new = self.list_of[i] > seen  # (numbered in order of first naming: only the next can be new)
            cost = _SHARD_FRAMING + len(shard.id) + len(shard.name.encode()) + sum(len(f) + 2 for f in shard.fields)
            cost += list_bytes[self.list_of[i] - 1] if new else 0
            if i > start and size + cost > limits.DESCRIBE_PAGE_BYTES:
                pages.append(_Page(start, i, lists, seen))
                start, lists, size = i, seen, 0
            if size + cost > limits.MAX_DESCRIBE_BYTES - limits.DESCRIBE_PAGE_BYTES // 4:
                names = self.class_lists[self.list_of[i] - 1]
                raise DescribeError(
                    f"shard {shard.name} names {len(names):,} classes, {cost:,} bytes of names: more than one "
                    f"Describe message may carry ({limits.MAX_DESCRIBE_BYTES:,} bytes)"
                )
            size += cost
            seen += new
        pages.append(_Page(start, len(self.shards), lists, seen))
        return pages

    def __len__(self) -> int:
        """Pages (at least one, empty where the server holds no shards)."""
        return len(self._pages)

    def fill(self, response: loader_pb2.DescribeResponse, shard_start: int) -> None:
        """Puts the page that starts at shard ``shard_start`` into ``response``; ValueError when no
        page starts there (a client that did not follow the pages it was given)."""
        page = self._pages.get(shard_start)
        if page is None:
            raise ValueError(
                f"shard_start={shard_start}: no page of this server's {len(self.shards)} shards starts there "
                f"(pages start at the shard after the previous page's last)"
            )
        response.num_shards = len(self.shards)
        response.shard_start = page.shard_start
        response.class_list_start = page.list_start
        for names in self.class_lists[page.list_start : page.list_end]:
            response.class_lists.add().names.extend(names)
        for i in range(page.shard_start, page.shard_end):
            s = self.shards[i]
            response.shards.add(id=s.id, name=s.name, num_samples=len(s), fields=s.fields, class_list=self.list_of[i])
