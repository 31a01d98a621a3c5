"""Which adapter versions a replica holds, who uses them, and when one may go.

Pure bookkeeping, no I/O and no torch, so the rules are testable on their own:

- `SlotTable`: version -> slot index of a fixed pool (the embedded engine's preallocated LoRA
  slots). Loading takes a free slot, unloading gives it back; nothing is ever allocated.
- `VersionBook`: the service's view: loaded versions, reference counts of in-flight requests
  pinning a version, and the keep window. A version is unloaded only when it is outside the
  window (not among the newest `keep` loaded versions) AND no request pins it.
"""

from __future__ import annotations


class NoFreeSlot(RuntimeError):
    """Every slot holds a version; one must be unloaded (its requests finished) first."""


class SlotTable:
    def __init__(self, slots: int):
        if slots < 1:
            raise ValueError(f"slots: {slots} must be >= 1 (lora_keep_versions + 1)")
        self.slots = slots
        self._slot_of: dict[int, int] = {}

    def assign(self, version: int) -> int:
        if version in self._slot_of:
            raise ValueError(f"version {version} is already loaded in slot {self._slot_of[version]}")
        used = set(self._slot_of.values())
        free = next((s for s in range(self.slots) if s not in used), None)
        if free is None:
            raise NoFreeSlot(
                f"all {self.slots} LoRA slots are in use (versions {sorted(self._slot_of)}); "
                "unload a version or raise rollout.lora_keep_versions"
            )
        self._slot_of[version] = free
        return free

    def release(self, version: int) -> int:
        if version not in self._slot_of:
            raise KeyError(f"version {version} is not loaded (loaded: {sorted(self._slot_of)})")
        return self._slot_of.pop(version)

    def slot_of(self, version: int) -> int:
        try:
            return self._slot_of[version]
        except KeyError:
            raise KeyError(f"version {version} is not loaded (loaded: {sorted(self._slot_of)})") from None

    def versions(self) -> list[int]:
        return sorted(self._slot_of)

    def free_slots(self) -> int:
        return self.slots - len(self._slot_of)


class VersionBook:
    def __init__(self, keep: int):
        if keep < 1:
            raise ValueError(f"rollout.lora_keep_versions: {keep} must be >= 1")
        self.keep = keep
        self._loaded: set[int] = set()
        self._pins: dict[int, int] = {}

    # --- what is loaded ---
    def loaded(self) -> list[int]:
        return sorted(self._loaded)

    def head(self) -> int | None:
        return max(self._loaded) if self._loaded else None

    def mark_loaded(self, version: int) -> None:
        self._loaded.add(version)

    def mark_unloaded(self, version: int) -> None:
        if self._pins.get(version, 0):
            raise RuntimeError(f"version {version} is pinned by {self._pins[version]} request(s)")
        self._loaded.discard(version)

    def window(self) -> list[int]:
        """The newest `keep` loaded versions: these stay loaded regardless of pins."""
        return sorted(self._loaded)[-self.keep :]

    def to_unload(self) -> list[int]:
        """Versions that may go now: outside the window and pinned by nobody."""
        inside = set(self.window())
        return sorted(v for v in self._loaded if v not in inside and not self._pins.get(v, 0))

    # --- who uses what ---
    def choose(self, granted: int | None = None) -> int:
        """The version a new request runs on: the registry's grant if given, else the head."""
        if granted is not None:
            if granted not in self._loaded:
                raise KeyError(f"granted version {granted} is not loaded here ({self.loaded()})")
            return granted
        head = self.head()
        if head is None:
            raise LookupError("no adapter version is loaded yet")
        return head

    def pin(self, version: int) -> None:
        if version not in self._loaded:
            raise KeyError(f"cannot pin version {version}: not loaded ({self.loaded()})")
        self._pins[version] = self._pins.get(version, 0) + 1

    def unpin(self, version: int) -> None:
        count = self._pins.get(version, 0)
        if count <= 0:
            raise RuntimeError(f"version {version} is not pinned; unpin without a matching pin")
        if count == 1:
            del self._pins[version]
        else:
            self._pins[version] = count - 1

    def pins(self, version: int) -> int:
        return self._pins.get(version, 0)

    def in_flight(self) -> int:
        return sum(self._pins.values())
