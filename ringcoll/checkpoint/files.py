"""A checkpoint on disk: a directory of raw shard files and one JSON manifest.

    ckpt/
      manifest.json       format, version, world and mesh, extra, the optimizer's type and
                          hyper-parameters, and for every tensor its global shape, dtype and
                          pieces (which shard file, where in it, which block, crc32)
      shard-00000.bin     rank 0's pieces, raw C-order bytes one after another (64-byte
      shard-00002.bin     aligned); a rank that writes nothing has no file

No pickle, no np.load: the manifest is JSON and the shards are bytes read into arrays of the
dtypes the manifest names (numeric ones only), so loading a checkpoint cannot run code.

Atomicity. Every file is written into a temporary sibling directory (`ckpt.tmp-<token>`),
fsynced, and the directory is renamed to `ckpt` last, after the manifest. A job killed at
any moment before the rename leaves `ckpt` as it was. Replacing an existing checkpoint takes
two renames (old aside to `ckpt.old-<token>`, new into place, then the old is deleted); a
job killed between the two leaves no `ckpt` but a complete `ckpt.old-<token>`, which
`resolve()` finds, so a reader always sees the previous or the new checkpoint, whole.
"""

import glob
import json
import os
import shutil
import zlib
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from ..errors import CheckpointError

FORMAT = "ringcoll-checkpoint"
VERSION = 2
MANIFEST = "manifest.json"
ALIGN = 64  # every piece starts at a multiple of this many bytes
READ_BLOCK = 4 << 20  # a piece is read in blocks of this many bytes, each checksummed beside
#                       the read of the next


def shard_file(rank):
    return f"shard-{rank:05d}.bin"


# -- writing -----------------------------------------------------------------------------------
def write_shard(filename, arrays):
    """Write the arrays one after another; returns (pieces, file record): per array its
    (offset, nbytes, crc32), and the file's {"nbytes"}. Flushed and fsynced.

    One crc32 pass over the bytes, per piece (what a reader checks), on a second thread while
    the piece is written (zlib and the write both release the GIL: with a free core the
    checksum costs no time); the file as a whole has its size, checked before any piece is
    read, and no checksum of its own, which would cost a second pass over every byte (zlib
    has no crc32_combine in Python)."""
    pieces, at, crcs = [], 0, []
    with open(filename, "xb") as f, ThreadPoolExecutor(1) as checksummer:
        for a in arrays:
            pad = -at % ALIGN
            if pad:
                f.write(bytes(pad))
                at += pad
            data = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
            crcs.append(checksummer.submit(zlib.crc32, data))  # beside the write: both
            f.write(data)                                      # release the GIL
            pieces.append((at, data.size))
            at += data.size
        f.flush()
        os.fsync(f.fileno())
    return [(off, n, crc.result()) for (off, n), crc in zip(pieces, crcs)], {"nbytes": at}


def write_manifest(folder, manifest):
    with open(os.path.join(folder, MANIFEST), "x") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def fsync_dir(folder):
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def commit(tmp, path, token):
    """Make the complete directory tmp the checkpoint at path (see the module docstring)."""
    fsync_dir(tmp)
    parent = os.path.dirname(os.path.abspath(path))
    if os.path.lexists(path):
        old = f"{path}.old-{token}"
        os.rename(path, old)
        os.rename(tmp, path)
        fsync_dir(parent)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, path)
        fsync_dir(parent)
    for stale in glob.glob(glob.escape(path) + ".tmp-*") + glob.glob(glob.escape(path) + ".old-*"):
        shutil.rmtree(stale, ignore_errors=True)  # what killed saves left behind


def replaceable(path, where):
    """Raise unless path is free or holds a ringcoll checkpoint (never replace anything
    else: a typo must not delete a directory of results)."""
    if not os.path.lexists(path):
        parent = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(parent):
            raise CheckpointError(f"{where}cannot save {path}: the directory {parent} does not "
                                  "exist; create it first", path=path, problem="write-failed")
        return
    if not (os.path.isdir(path) and os.path.isfile(os.path.join(path, MANIFEST))):
        raise CheckpointError(f"{where}{path} exists and is not a ringcoll checkpoint; "
                              "refusing to replace it (remove it or save elsewhere)",
                              path=path, problem="not-a-checkpoint")
    read_manifest(path, where)  # one of ours, of a version we may replace


# -- reading -----------------------------------------------------------------------------------
def resolve(path):
    """The directory to read for path: path itself, or (when a save was killed between its
    two renames) the complete previous checkpoint it had set aside."""
    if os.path.lexists(path):
        return path
    aside = sorted(glob.glob(glob.escape(path) + ".old-*"))
    aside = [a for a in aside if os.path.isfile(os.path.join(a, MANIFEST))]
    return aside[-1] if aside else path


def read_manifest(path, where):
    """The manifest of the checkpoint at path, checked; CheckpointError names what is wrong."""
    if not os.path.lexists(path):
        raise CheckpointError(f"{where}no checkpoint at {path} (it does not exist)", path=path,
                              problem="missing")
    if not os.path.isdir(path):
        raise CheckpointError(f"{where}{path} is a file, not a ringcoll checkpoint (a "
                              "directory holding manifest.json and shard files)", path=path,
                              problem="not-a-checkpoint")
    name = os.path.join(path, MANIFEST)
    if not os.path.isfile(name):
        raise CheckpointError(f"{where}{path} is not a ringcoll checkpoint (it has no "
                              f"{MANIFEST})", path=path, problem="not-a-checkpoint")
    try:
        with open(name, "rb") as f:
            manifest = json.loads(f.read())
    except (UnicodeDecodeError, ValueError) as exc:
        raise CheckpointError(f"{where}{name} is corrupt (not JSON: {exc}); the checkpoint "
                              "cannot be read", path=name, problem="corrupt") from exc
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{where}{name} is not a ringcoll checkpoint manifest (no "
                              f"format {FORMAT!r})", path=name, problem="not-a-checkpoint")
    version = manifest.get("version")
    if not isinstance(version, int) or version < VERSION:
        raise CheckpointError(f"{where}{name} has format version {version!r}; this ringcoll "
                              f"reads version {VERSION}", path=name, problem="not-a-checkpoint")
    if version > VERSION:
        raise CheckpointError(f"{where}{path} was written by a newer ringcoll (checkpoint "
                              f"format {version}; this one reads up to {VERSION}); upgrade "
                              "ringcoll to load it", path=name, problem="newer-version")
    if not isinstance(manifest.get("tensors"), dict):
        raise CheckpointError(f"{where}{name} is corrupt (no tensor table)", path=name,
                              problem="corrupt")
    return manifest


class ShardReader:
    """Reads pieces out of a checkpoint's shard files, each checked against the manifest's
    size and crc32; keeps the files open until close()."""

    def __init__(self, folder, manifest, where):
        self.folder, self.manifest, self.where = folder, manifest, where
        self.files = {}
        self.bytes_read = 0
        # checksums run on this thread while the next block is read (both release the GIL)
        self.checksummer = ThreadPoolExecutor(1)

    def _open(self, name):
        f = self.files.get(name)
        if f is None:
            full = os.path.join(self.folder, name)
            record = self.manifest.get("shards", {}).get(name)
            if record is None or os.path.basename(name) != name:
                raise CheckpointError(f"{self.where}{self.folder}/{MANIFEST} is corrupt (it "
                                      f"names the unknown shard {name!r})",
                                      path=os.path.join(self.folder, MANIFEST),
                                      problem="corrupt")
            try:
                f = open(full, "rb")
            except FileNotFoundError:
                raise CheckpointError(f"{self.where}shard {full} is missing: the checkpoint "
                                      "is damaged (its manifest names the file)", path=full,
                                      problem="corrupt") from None
            size = os.fstat(f.fileno()).st_size
            if size != record["nbytes"]:
                f.close()
                raise CheckpointError(f"{self.where}shard {full} is truncated or corrupt: "
                                      f"{size} bytes, the manifest says {record['nbytes']}",
                                      path=full, problem="corrupt")
            self.files[name] = f
        return f

    def read(self, piece, dtype, key, into=None):
        """The piece's array (shape piece["shape"], the given dtype), checked; read straight
        into `into` (a C-contiguous array of that shape and dtype) when given."""
        f = self._open(piece["shard"])
        full = os.path.join(self.folder, piece["shard"])
        nbytes = int(np.prod(piece["shape"], dtype=np.int64)) * dtype.itemsize
        if nbytes != piece["nbytes"]:
            raise CheckpointError(f"{self.where}{self.folder}/{MANIFEST} is corrupt ({key}: "
                                  f"{piece['nbytes']} bytes for a {piece['shape']} {dtype})",
                                  path=os.path.join(self.folder, MANIFEST), problem="corrupt")
        data = np.empty(nbytes, np.uint8) if into is None else into.reshape(-1).view(np.uint8)
        crc = [0]  # the crc32 of the blocks read so far, computed beside the next read

        def add(block):
            crc[0] = zlib.crc32(block, crc[0])

        try:
            f.seek(piece["offset"])
            got, pending = 0, []
            while got < nbytes:
                block = data[got:got + READ_BLOCK]
                n = f.readinto(block)
                if not n:
                    break
                pending.append(self.checksummer.submit(add, block[:n]))  # in order: 1 thread
                got += n
            for job in pending:
                job.result()
        except (OSError, ValueError, OverflowError) as exc:  # an offset no file has
            raise CheckpointError(f"{self.where}{self.folder}/{MANIFEST} is corrupt ({key} at "
                                  f"offset {piece['offset']!r}: {exc})",
                                  path=os.path.join(self.folder, MANIFEST),
                                  problem="corrupt") from None
        if got != nbytes:
            raise CheckpointError(f"{self.where}shard {full} is truncated ({key} runs past its "
                                  "end)", path=full, problem="corrupt")
        if crc[0] != piece["crc32"]:
            raise CheckpointError(f"{self.where}shard {full} is corrupt: the checksum of {key} "
                                  f"(bytes {piece['offset']}..{piece['offset'] + nbytes}) does "
                                  "not match the manifest's", path=full, problem="corrupt")
        self.bytes_read += nbytes
        return data.view(dtype).reshape(piece["shape"])

    def close(self):
        for f in self.files.values():
            f.close()
        self.files.clear()
        self.checksummer.shutdown()
