"""A small least-recently-used cache and a tiny INI-style configuration reader.

Sample input for seqkv: ordinary, idiomatic Python that a model reads as code rather than
prose. It depends only on the standard library and runs as a script to show both pieces.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass, field
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")

_MISSING = object()


class LRUCache(Generic[K, V]):
    """Bounded mapping that evicts the entry untouched for the longest time.

    An OrderedDict keeps insertion order and can move a key to the end in O(1), so the
    oldest entry is always at the front and eviction needs no separate bookkeeping.
    """

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError(f"capacity must be positive, got {capacity}")
        self.capacity = capacity
        self._data: OrderedDict[K, V] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._data)

    def __contains__(self, key: object) -> bool:
        return key in self._data

    def __iter__(self) -> Iterator[K]:
        """Iterate from least to most recently used, without changing the order."""
        return iter(self._data)

    def get(self, key: K, default: V | None = None) -> V | None:
        """Return the cached value and mark it as recently used."""
        value = self._data.get(key, _MISSING)
        if value is _MISSING:
            self.misses += 1
            return default
        self.hits += 1
        self._data.move_to_end(key)
        return value  # type: ignore[return-value]

    def put(self, key: K, value: V) -> K | None:
        """Store a value; return the evicted key, if the cache had to make room."""
        if key in self._data:
            self._data.move_to_end(key)
            self._data[key] = value
            return None
        self._data[key] = value
        if len(self._data) > self.capacity:
            evicted, _ = self._data.popitem(last=False)
            return evicted
        return None

    def hit_rate(self) -> float:
        """Fraction of lookups served from the cache, 0.0 before the first lookup."""
        total = self.hits + self.misses
        return self.hits / total if total else 0.0


def memoize(capacity: int) -> Callable[[Callable[[int], int]], Callable[[int], int]]:
    """Decorate a one-argument function so repeated calls reuse an LRU cache."""

    def decorator(func: Callable[[int], int]) -> Callable[[int], int]:
        cache: LRUCache[int, int] = LRUCache(capacity)

        def wrapper(arg: int) -> int:
            cached = cache.get(arg)
            if cached is not None:
                return cached
            result = func(arg)
            cache.put(arg, result)
            return result

        wrapper.cache = cache  # type: ignore[attr-defined]
        wrapper.__name__ = func.__name__
        wrapper.__doc__ = func.__doc__
        return wrapper

    return decorator


class ConfigError(ValueError):
    """Raised for malformed configuration text, with the offending line number."""

    def __init__(self, line_no: int, message: str) -> None:
        super().__init__(f"line {line_no}: {message}")
        self.line_no = line_no


@dataclass
class Config:
    """Parsed configuration: section name -> key -> raw string value."""

    sections: dict[str, dict[str, str]] = field(default_factory=dict)

    def get(self, section: str, key: str, fallback: str | None = None) -> str | None:
        return self.sections.get(section, {}).get(key, fallback)

    def get_int(self, section: str, key: str, fallback: int = 0) -> int:
        raw = self.get(section, key)
        return fallback if raw is None else int(raw)

    def get_bool(self, section: str, key: str, fallback: bool = False) -> bool:
        """Accept the usual spellings so hand-edited files stay forgiving."""
        raw = self.get(section, key)
        if raw is None:
            return fallback
        lowered = raw.strip().lower()
        if lowered in {"1", "yes", "true", "on"}:
            return True
        if lowered in {"0", "no", "false", "off"}:
            return False
        raise ValueError(f"[{section}] {key} is not a boolean: {raw!r}")


def parse_config(text: str) -> Config:
    """Parse INI-style text: [sections], key = value pairs, and # or ; comments.

    Keys before the first section go into a section named "default". Later duplicates of a
    key replace earlier ones, matching what people expect when they append an override.
    """
    config = Config()
    current = "default"
    for line_no, raw_line in enumerate(text.splitlines(), start=1):
        line = raw_line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            if not line.endswith("]") or len(line) < 3:
                raise ConfigError(line_no, f"bad section header {line!r}")
            current = line[1:-1].strip()
            config.sections.setdefault(current, {})
            continue
        key, sep, value = line.partition("=")
        if not sep:
            raise ConfigError(line_no, f"expected 'key = value', got {line!r}")
        key = key.strip().lower()
        if not key:
            raise ConfigError(line_no, "empty key")
        config.sections.setdefault(current, {})[key] = value.strip()
    return config


SAMPLE_CONFIG = """
# Settings for a small web service
name = demo-service

[server]
host = 127.0.0.1
port = 8080
debug = yes

[cache]
capacity = 3
; values are kept as strings until a typed getter asks for them
"""


def main() -> None:
    config = parse_config(SAMPLE_CONFIG)
    print("service:", config.get("default", "name"))
    print("listen on", config.get("server", "host"), config.get_int("server", "port"))
    print("debug:", config.get_bool("server", "debug"))

    cache: LRUCache[str, int] = LRUCache(config.get_int("cache", "capacity"))
    for word in ["apple", "pear", "plum", "apple", "fig", "pear"]:
        if cache.get(word) is None:
            evicted = cache.put(word, len(word))
            note = f" (evicted {evicted})" if evicted else ""
            print(f"miss {word}{note}")
        else:
            print(f"hit  {word}")
    print("order, oldest first:", list(cache))
    print(f"hit rate: {cache.hit_rate():.2f}")

    @memoize(capacity=64)
    def fib(n: int) -> int:
        """Naive recursion made fast by the cache."""
        return n if n < 2 else fib(n - 1) + fib(n - 2)

    print("fib(60) =", fib(60))

    try:
        parse_config("[broken\nkey = value")
    except ConfigError as exc:
        print("rejected:", exc)


if __name__ == "__main__":
    main()
