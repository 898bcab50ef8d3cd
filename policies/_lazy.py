"""A tuple made when it is first read, for what a decision carries that most readers never look at."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TypeVar, overload

_T = TypeVar("_T")


class LazyTuple(Sequence[_T]):
    """A sequence that is the tuple :meth:`all` makes the first time it is read (a subclass says how, and its
    length without making it): read, compared, hashed, printed and pickled as that plain tuple."""

    __slots__ = ()

    def all(self) -> tuple[_T, ...]:
        raise NotImplementedError

    @overload
    def __getitem__(self, index: int) -> _T: ...

    @overload
    def __getitem__(self, index: slice) -> tuple[_T, ...]: ...

    def __getitem__(self, index: int | slice) -> _T | tuple[_T, ...]:
        return self.all()[index]

    def __iter__(self) -> Iterator[_T]:
        return iter(self.all())

    def __reduce__(self) -> tuple[type, tuple[tuple[_T, ...]]]:
        return tuple, (self.all(),)  # a copy in another process is the plain tuple

    def __eq__(self, other: object) -> bool:
        if isinstance(other, LazyTuple | tuple):
            return self.all() == tuple(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.all())

    def __repr__(self) -> str:
        return repr(self.all())
