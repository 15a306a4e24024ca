"""What the reader knows of a run's files: which it skipped (damaged, cut short, missing or foreign) and the
reads of their entries, each checked against its checksum (store format 2, docs/format.md).

`CheckedFiles` is a part of `Run` (its base class); it holds no state of its own, and reads the run's `store`,
`url`, `skipped`, `_foreign_files`, `_listed` (worker -> shard numbers listed), `_sections` (series sections
kept in memory) and `verdicts()`."""

from __future__ import annotations

import warnings

from .errors import RunDamaged
from .headers import StoredFile
from .shardfile import Entry, ShardFormatError
from .store import SHARD_RE, TEMP_PREFIX, count_of, shard_name

SECTION_CACHE_BYTES = 4 << 20  # series sections up to this size are read whole, and verified when a file loads


class CheckedFiles:
    @property
    def damaged(self) -> dict[str, str]:
        """{file: why} of the run's own files found damaged, cut short or missing (`skipped` also lists files
        that are not tripwire's). Reads the workers' statuses, which count the shards they wrote, and the
        verdicts."""
        self._check_tails(self._statuses())
        self.verdicts()
        return {rel: why for rel, why in self.skipped.items() if rel not in self._foreign_files}

    def damage_note(self) -> str | None:
        """One line naming the damaged files, for every verb to print; None for a sound run."""
        damaged = sorted(self.damaged)
        if not damaged:
            return None
        return (f"{self.url} is damaged: {len(damaged)} file(s) changed after they were written, cut short or missing "
                f"({', '.join(damaged[:5])}{', …' if len(damaged) > 5 else ''}); what they held is left out.")

    def _skip(self, rel: str, reason: str) -> None:
        if rel not in self.skipped:
            self.skipped[rel] = reason
            warnings.warn(f"tripwire: skipped {self.url}/{rel}: {reason}", stacklevel=3)

    def _foreign(self, rel: str) -> None:
        if not rel.rsplit("/", 1)[-1].startswith(TEMP_PREFIX):
            self._foreign_files.add(rel)
            self._skip(rel, "not a tripwire file (unexpected name)")

    def _check_tails(self, statuses: dict[int, dict]) -> None:
        """Where a worker's status counts more shards than were listed, look again (a status is written after the
        shards it counts) and name the missing: the last shards of a run are lost without a gap to show it."""
        behind = {w: count_of(s.get("shards")) for w, s in statuses.items()
                  if count_of(s.get("shards")) > max(self._listed[w], default=-1) + 1}
        if not behind:
            return
        for name in self.store.list("shards"):
            m = SHARD_RE.match(name)
            if m and int(m.group(1)) in behind:
                self._listed[int(m.group(1))].add(int(m.group(2)))
        for worker, written in behind.items():
            for seq in sorted(set(range(written)) - self._listed[worker]):
                self._skip(shard_name(worker, seq), "missing: its worker's status says it was written")

    def _verify_section(self, file: StoredFile, prefix: bytes, entries: list) -> None:
        """Verify the checksums of a file's series and steps before any of them is used, where that costs at most
        one read of SECTION_CACHE_BYTES (most shards: none beyond the header's); the section is kept for the
        reads that follow. A larger section (a long run's index) is verified entry by entry as it is read."""
        section = file.section()
        if not section or section[1] - section[0] > SECTION_CACHE_BYTES:
            return
        blob = prefix[section[0]:section[1]]
        if len(blob) != section[1] - section[0]:
            blob = self.store.get(file.rel, *section)
        for entry in entries:
            entry.decode(blob[entry.begin - section[0]:entry.end - section[0]])
        self._keep_section(file.rel, blob)

    def _keep_section(self, rel: str, blob: bytes) -> None:
        self._sections[rel] = blob
        if sum(map(len, self._sections.values())) > 64 * SECTION_CACHE_BYTES:
            self._sections.pop(next(iter(self._sections)))

    def _read(self, file: StoredFile, entry: Entry):
        section = file.section()
        if section and entry.end <= section[1] and section[1] - section[0] <= SECTION_CACHE_BYTES:
            blob = self._sections.get(file.rel)
            if blob is None:
                blob = self.store.get(file.rel, *section)
                self._keep_section(file.rel, blob)
            return self._decode(file.rel, entry, blob[entry.begin - section[0]:entry.end - section[0]])
        return self._decode(file.rel, entry, self._get(file.rel, entry))

    def _get(self, rel: str, entry: Entry) -> bytes:
        try:
            return self.store.get(rel, entry.begin, entry.end)
        except FileNotFoundError:
            self._skip(rel, "missing: it was there when the run was opened")
            raise RunDamaged(f"{self.url}/{rel} is missing: it was there when the run was opened (or its "
                             "index names it) and holds data asked for.") from None

    def _decode(self, rel: str, entry: Entry, data: bytes):
        """The entry's values, its checksum verified: RunDamaged, naming the file, where they do not match."""
        try:
            return entry.decode(data)
        except ShardFormatError as exc:
            self._skip(rel, f"damaged: {exc}")
            raise RunDamaged(f"{self.url}/{rel} is damaged: {exc}. What it holds cannot be read; the rest of "
                             "the run can (run.skipped lists every damaged file found).") from None

