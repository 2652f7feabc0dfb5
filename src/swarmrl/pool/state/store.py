"""The rollout store: every submission's signed body, in a local directory or any fsspec URL.

A submission is stored as the exact body its node signed, zstd-compressed: the JSON of a
:class:`~swarmrl.protocol.pool.Submission`, whose samples are the rollouts. Readers parse the
samples out of it (:meth:`RolloutStore.get_samples`), and anyone can re-derive the body's
digest and re-check the node's signature (``swarmrl.pool.trust.audit.check_node_signature``). The
signed body already holds every sample exactly as submitted, so a second copy in another
encoding is not written: building and writing it had cost a submission a third of its CPU.

In a local directory the bodies are records of append-only segment files, one folder per pool
(``<pool>/segments/``, :mod:`swarmrl.pool.state.segments`): :meth:`RolloutStore.put_request` returns
the reference to keep, ``<key>#<segment>@<offset>+<length>``, and every reader takes either
that reference or the bare key (found by scanning the segments: what a third party holding only
the ledger does). Elsewhere (an fsspec URL) each body is a file of its own,
``<key>.request.zst``, and the reference is the key; such files are also read in a local
directory (stores written before segments).

Samples may also sit in a Parquet file under ``<key>`` itself (stores written before the
request was the only copy, and :meth:`RolloutStore.put_samples`); where that file exists it is
read instead. Its columns (one row per sample): ``task_index`` int64, ``prompt_tokens``
list<int32> [P], ``output_tokens`` list<int32> [T], ``logprobs`` list<float64> [T] (exactly
the submitted values), ``finish_reason`` string, ``policy_version`` int64, ``proof`` string
(canonical JSON of a proof object, ``hex:<bytes>`` for hex proofs, null for none). Validator
log-probs go to ``<key>.behaviour.parquet`` with one column ``behaviour_logprobs``
list<float64> [T].

Writes go to a temporary name and are renamed into place, so a reader never sees half a file
(on a local directory with plain system calls: fsspec's per-call overhead was a fifth of a
submission's CPU). Parquet files carry no column statistics and no dictionary pages: nothing
filters on them, and writing them cost a third of the Parquet write. A stored file that cannot
be read back as samples (damaged, or not a submission) raises :class:`ValueError` (or
:class:`OSError` where it is missing). Knows nothing about leases or verdicts.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import uuid
from typing import Any

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
import zstandard
from fsspec.implementations.local import LocalFileSystem
from pydantic import ValidationError

from swarmrl.errors import DiskWriteError
from swarmrl.identity.keys import canonical_json
from swarmrl.pool.state.segments import Location, SegmentLog
from swarmrl.protocol.pool import Sample, Submission

ROLLOUT_SCHEMA = pa.schema(
    [
        ("task_index", pa.int64()),
        ("prompt_tokens", pa.list_(pa.int32())),
        ("output_tokens", pa.list_(pa.int32())),
        ("logprobs", pa.list_(pa.float64())),
        ("finish_reason", pa.string()),
        ("policy_version", pa.int64()),
        ("proof", pa.string()),
    ]
)


def _proof_text(proof: dict[str, Any] | str | None) -> str | None:
    if proof is None:
        return None
    return "hex:" + proof if isinstance(proof, str) else canonical_json(proof).decode()


def _proof_value(text: str | None) -> dict[str, Any] | str | None:
    if text is None:
        return None
    return text[4:] if text.startswith("hex:") else json.loads(text)


def split_reference(ref: str) -> tuple[str, Location | None]:
    """A stored submission's reference as its key and, for a record in a segment, where that
    record lies; :class:`ValueError` for a reference with a malformed location."""
    key, sep, where = ref.partition("#")
    return key, Location.parse(where) if sep else None


class RolloutStore:
    """Parquet rollouts under ``url`` (a directory path or fsspec URL)."""

    def __init__(self, url: str) -> None:
        self.fs, self.root = fsspec.core.url_to_fs(url)
        self.fs.makedirs(self.root, exist_ok=True)
        self.local = isinstance(self.fs, LocalFileSystem)
        self._made: set[str] = set()  # local directories known to exist
        # level 1: a body of 16 samples × 1,000 tokens (676 kB of JSON) compresses in 1.2 ms to
        # 344 kB, at level 3 in 4.9 ms to 348 kB (the digits of the log-probs barely compress)
        self._zstd = zstandard.ZstdCompressor(level=1, write_checksum=True)
        self._logs: dict[str, SegmentLog] = {}  # by pool folder

    def _log(self, key: str) -> SegmentLog:
        folder = key.rsplit("/", 1)[0] if "/" in key else ""
        log = self._logs.get(folder)
        if log is None:
            log = self._logs[folder] = SegmentLog(self._path(f"{folder}/segments"))
        return log

    def _path(self, key: str) -> str:
        return f"{self.root.rstrip('/')}/{key}"

    def _write(self, key: str, table: pa.Table) -> None:
        buffer = io.BytesIO()
        pq.write_table(
            table, buffer, compression="zstd", write_statistics=False, use_dictionary=False
        )
        self._write_bytes(self._path(key), buffer.getvalue())

    def _write_bytes(self, path: str, data: bytes) -> None:
        """Write ``data`` to ``path`` through a temporary file renamed into place; a failed
        write (a full disk) leaves no temporary file and is one :class:`DiskWriteError`."""
        tmp = f"{path}.{uuid.uuid4().hex}.tmp"
        try:
            if self.local:
                self._write_local(path, tmp, data)
            else:
                self.fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
                with self.fs.open(tmp, "wb") as handle:
                    handle.write(data)
                self.fs.mv(tmp, path)
        except OSError as exc:
            with contextlib.suppress(OSError):
                self.fs.rm(tmp)
            raise DiskWriteError(f"cannot write {path}: {exc.strerror or exc}") from exc

    def _write_local(self, path: str, tmp: str, data: bytes) -> None:
        folder = path.rsplit("/", 1)[0]
        if folder not in self._made:
            os.makedirs(folder, exist_ok=True)
            self._made.add(folder)
        with open(tmp, "wb") as handle:
            handle.write(data)
        os.replace(tmp, path)

    def put_samples(self, key: str, samples: list[Sample]) -> None:
        columns: dict[str, list[Any]] = {name: [] for name in ROLLOUT_SCHEMA.names}
        for s in samples:
            columns["task_index"].append(s.task_index)
            columns["prompt_tokens"].append(s.prompt_tokens)
            columns["output_tokens"].append(s.output_tokens)
            columns["logprobs"].append(s.logprobs)
            columns["finish_reason"].append(s.finish_reason)
            columns["policy_version"].append(s.policy_version)
            columns["proof"].append(_proof_text(s.proof))
        self._write(key, pa.table(columns, schema=ROLLOUT_SCHEMA))

    def get_samples(self, key: str) -> list[Sample]:
        """The samples stored under ``key``: its Parquet file's where there is one, else those
        of the signed request body (see the module docstring)."""
        path = self._path(split_reference(key)[0])
        if self.fs.exists(path):
            with self.fs.open(path, "rb") as handle:
                rows = pq.read_table(handle).to_pylist()
            return [Sample(**{**row, "proof": _proof_value(row["proof"])}) for row in rows]
        body = self.get_request(key)
        try:  # parsed as on arrival (swarmrl.pool.web.hotroutes): pydantic's parser, else FastAPI's
            return Submission.model_validate_json(body).samples
        except ValidationError:
            return Submission.model_validate(json.loads(body)).samples

    def put_behaviour(self, key: str, logprobs: list[list[float]]) -> None:
        table = pa.table({"behaviour_logprobs": pa.array(logprobs, pa.list_(pa.float64()))})
        self._write(split_reference(key)[0] + ".behaviour.parquet", table)

    def get_behaviour(self, key: str) -> list[list[float]] | None:
        path = self._path(split_reference(key)[0] + ".behaviour.parquet")
        if not self.fs.exists(path):
            return None
        with self.fs.open(path, "rb") as handle:
            return pq.read_table(handle).column("behaviour_logprobs").to_pylist()

    def put_request(self, key: str, body: bytes) -> str:
        """Keep the request body a node signed for the submission stored under ``key``; the
        reference to read it back by (see the module docstring)."""
        compressed = self._zstd.compress(body)
        if not self.local:
            self._write_bytes(self._path(key + ".request.zst"), compressed)
            return key
        try:
            location = self._log(key).append(key, compressed)
        except OSError as exc:
            raise DiskWriteError(f"cannot store {key}: {exc.strerror or exc}") from exc
        return f"{key}#{location}"

    def get_request(self, ref: str) -> bytes:
        """The signed request body kept by :meth:`put_request`, by its reference or its key:
        :class:`OSError` where there is none, :class:`ValueError` where the stored bytes are
        not one."""
        key, location = split_reference(ref)
        path = self._path(key + ".request.zst")
        log = self._log(key) if self.local else None
        if log is not None and location is None and not os.path.exists(path):
            location = log.find(key)
            if location is None:
                raise FileNotFoundError(f"no stored request under {key}")
        if location is not None:
            if log is None:
                raise ValueError(f"{ref!r}: a segment location in a store without segments")
            compressed = log.read(location, key)
            path = f"{log.folder}/{location}"
        else:
            with self.fs.open(path, "rb") as handle:
                compressed = handle.read()
        try:
            return zstandard.ZstdDecompressor().decompress(compressed)
        except zstandard.ZstdError as exc:
            raise ValueError(f"{path} is not a zstd frame: {exc}") from exc

    def delete(self, key: str) -> None:
        """Remove a submission's files; a body kept in a segment is no longer found by its key
        (its bytes stay in the segment until it is removed whole)."""
        key = split_reference(key)[0]
        for path in (
            self._path(key),
            self._path(key + ".behaviour.parquet"),
            self._path(key + ".request.zst"),
        ):
            if self.fs.exists(path):
                self.fs.rm(path)
        if self.local:
            try:
                self._log(key).delete(key)
            except OSError as exc:
                raise DiskWriteError(f"cannot delete {key}: {exc.strerror or exc}") from exc
