"""The corpus: the `.py` files of the running interpreter's standard library, split by file.

Each file goes to one split by a hash of its path relative to the library root, so the split
does not depend on which other files exist, on their order, or on the machine:
validation (default 5% of files, never seen by the tokenizer or the weights), dev (a further 3%,
used only to choose which training checkpoint to keep) and train (the rest).
"""

from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

EOT = "<|endoftext|>"
# Test suites are not the library (and some are deliberately malformed); site-packages is not ours;
# pydoc_data holds one generated module, topics.py: ~0.8 MB of English reference text in string
# literals, which would otherwise be over half of the validation split's bytes (it hashes there).
SKIPPED_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__", "pydoc_data"})
TRAIN, DEV, VALIDATION = "train", "dev", "validation"
SPLITS = (TRAIN, DEV, VALIDATION)


@dataclass(frozen=True)
class SourceFile:
    path: str  # relative to the corpus root, '/'-separated: the split is keyed on it
    text: str

    @property
    def n_bytes(self) -> int:
        return len(self.text.encode("utf-8"))


@dataclass
class Corpus:
    root: str
    splits: dict[str, list[SourceFile]]  # split name -> files in sorted path order
    undecodable: list[str] = field(default_factory=list)  # relative paths skipped: not UTF-8

    def texts(self, split: str) -> list[str]:
        return [f.text for f in self.splits[split]]

    def summary(self) -> dict:
        """Counts, bytes and a digest per split: what the model card reports."""
        out = {"root": self.root, "undecodable_skipped": list(self.undecodable)}
        for name, files in self.splits.items():
            digest = hashlib.sha256()
            for f in files:
                digest.update(f.path.encode() + b"\0" + f.text.encode("utf-8") + b"\0")
            out[name] = {"files": len(files), "bytes": sum(f.n_bytes for f in files), "sha256": digest.hexdigest()}
        return out


def stdlib_root() -> Path:
    """The running interpreter's standard library directory."""
    return Path(sysconfig.get_paths()["stdlib"])


def list_sources(root: Path) -> list[str]:
    """Relative paths of every `.py` file under `root`, skipping SKIPPED_DIRS at any depth; sorted."""
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"corpus root {root} is not a directory")
    found = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if any(part in SKIPPED_DIRS for part in rel.parts[:-1]) or not path.is_file():
            continue
        found.append(rel.as_posix())
    return sorted(found)


def split_of(rel_path: str, val_fraction: float, dev_fraction: float) -> str:
    """The split a file belongs to: a uniform draw in [0, 1) from the SHA-256 of its relative path.
    Validation takes [0, val_fraction), dev the next dev_fraction: disjoint by construction, and
    the validation set does not move when dev_fraction changes."""
    u = int.from_bytes(hashlib.sha256(rel_path.encode("utf-8")).digest()[:8], "big") / 2.0**64
    if u < val_fraction:
        return VALIDATION
    if u < val_fraction + dev_fraction:
        return DEV
    return TRAIN


def load_corpus(root: Path | None = None, val_fraction: float = 0.05, dev_fraction: float = 0.03) -> Corpus:
    """Read and split the corpus under `root` (default: the standard library)."""
    if not (0 < val_fraction < 1 and 0 <= dev_fraction < 1 and val_fraction + dev_fraction < 1):
        raise ValueError(f"val_fraction {val_fraction} and dev_fraction {dev_fraction} must be in [0, 1) and sum below 1 "
                         "(val_fraction above 0)")
    root = Path(root) if root is not None else stdlib_root()
    splits: dict[str, list[SourceFile]] = {name: [] for name in SPLITS}
    undecodable = []
    for rel in list_sources(root):
        try:
            text = (root / rel).read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            undecodable.append(rel)
            continue
        splits[split_of(rel, val_fraction, dev_fraction)].append(SourceFile(rel, text))
    for name in (TRAIN, VALIDATION):
        if not splits[name]:
            raise ValueError(f"corpus {root}: the {name} split is empty (val_fraction {val_fraction}, "
                             f"dev_fraction {dev_fraction}, {sum(map(len, splits.values()))} files)")
    return Corpus(str(root), splits, undecodable)
