"""Every rank's object, in one all-gather.

``torch.distributed.all_gather_object`` (accelerate's ``gather_object``)
takes two collectives: the sizes, then the pickled bytes padded to the
largest. An epoch's end gathers twice (``history_sync``), and on 2
processes each collective cost about half a millisecond of it. Here each
rank sends its length and its bytes in a buffer whose size every rank knows
already: the room the last gather of the same site needed, which every rank
saw alike. Once a site's payloads settle, a gather is one collective; a
payload past the room sends its remainder in a second, and grows the room.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy
import torch

if TYPE_CHECKING:
    from accel_mixin.distributed.control import _Gloo

__all__ = ["Gather", "ObjectGather"]

# every rank's object, by rank, given the call's name: a coordinator's ``gather``
Gather = Callable[[str, Any], list[Any]]

_HEADER = 8  # the payload's length, little-endian
_FIRST_ROOM = 4096


class ObjectGather:
    """Gathers on one gloo group, keeping each site's room."""

    def __init__(self) -> None:
        self._rooms: dict[str, int] = {}

    def __call__(self, group: _Gloo, num_processes: int, site: str, obj: Any) -> list[Any]:
        """Every rank's ``obj``, by rank; ``site`` names the call, which every
        rank makes alike."""
        data = numpy.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), numpy.uint8)
        room = self._rooms.get(site, _FIRST_ROOM)
        first = _all_gather(group, num_processes, _framed(data, room))
        lengths = [int.from_bytes(row[:_HEADER].numpy().tobytes(), "little") for row in first]
        largest = max(lengths)
        rows = [row[_HEADER:] for row in first]
        if largest > room:
            rest = torch.zeros(largest - room, dtype=torch.uint8)
            rest.numpy()[: max(0, len(data) - room)] = data[room:]
            rows = [
                torch.cat([row, tail])
                for row, tail in zip(rows, _all_gather(group, num_processes, rest))
            ]
            # a power of two: a payload that grows by an epoch's batches gets
            # a second collective a few times, not at every epoch
            self._rooms[site] = 1 << (largest - 1).bit_length()
        return [pickle.loads(row[:length].numpy().data) for row, length in zip(rows, lengths)]


def _framed(data: numpy.ndarray[Any, Any], room: int) -> torch.Tensor:
    """``data``'s length, then as much of it as ``room`` holds."""
    framed = torch.zeros(_HEADER + room, dtype=torch.uint8)
    head = framed.numpy()
    head[:_HEADER] = numpy.frombuffer(len(data).to_bytes(_HEADER, "little"), numpy.uint8)
    kept = min(len(data), room)
    head[_HEADER : _HEADER + kept] = data[:kept]
    return framed


def _all_gather(group: _Gloo, num_processes: int, tensor: torch.Tensor) -> list[torch.Tensor]:
    gathered = [torch.empty_like(tensor) for _ in range(num_processes)]
    group.allgather([gathered], [tensor]).wait()
    return gathered
