"""A fake Trankit model cache, so the real `trankit` package (1.1.2) runs offline in tests.

`build_fake_trankit_cache(cache_dir)` writes, in about a second and ~12 MB, everything that
`trankit.Pipeline('english', cache_dir=str(cache_dir), gpu=False)` reads:

    <cache_dir>/xlm-roberta-base/                  trankit's cache_dir/<embedding name>; trankit calls
                                                   XLMRobertaTokenizer/XLMRobertaModel.from_pretrained(
                                                   'xlm-roberta-base', cache_dir=<cache_dir>/xlm-roberta-base),
                                                   so this is a hub cache:
        models--xlm-roberta-base/refs/main         -> FAKE_REVISION
        models--xlm-roberta-base/snapshots/<FAKE_REVISION>/
            config.json                            1 layer, 1 head, hidden 768 (trankit hard-codes 768),
            model.safetensors                      intermediate 32, vocab = the sentencepiece model's + 2 (fp16)
            sentencepiece.bpe.model                a tiny unigram model trained here on generated English
            tokenizer_config.json, special_tokens_map.json
        english/
            english.downloaded                     empty marker: trankit then skips downloading english.zip
            english.vocabs.json                    tag sets: FAKE_UPOS, FAKE_XPOS, FAKE_FEATS, FAKE_DEPREL
            english.tokenizer.mdl                  torch.save({'adapters': {...}, 'epoch': 0}) as trankit's trainer
            english.tagger.mdl                     writes it: the task adapter of the XLM-R layer plus the head
            english.ner.mdl                        (TokenizerClassifier / PosDepClassifier / NERClassifier)
            english.ner-vocab.json                 BIOES labels over FAKE_NER_TYPES
            english_lemmatizer.pt                  trankit's lemma Trainer checkpoint (a tiny Seq2SeqModel)

English (UD_English-EWT) has no multi-word-token model in Trankit, so there is no mwt file and no token
carries 'expanded'.

The weights are seeded and random where it does not matter, and set by hand where a test needs stable
behaviour:

* Tokenization is deterministic and sensible. The XLM-R layer's attention is built so that each word piece
  sees whether the *next* piece starts a new pseudo-token (trankit first splits text at whitespace and
  punctuation), and the tokenizer head ends a token exactly there. So the tokens are what
  `trankit.utils.tokenizer_utils.split_to_substrings` gives ("Ana Bell born?" -> "Ana", "Bell", "born", "?"),
  and a sentence ends after '.', '?' or '!' (after the last of a run like "?!" or "..."), or at a blank line.
  Characters outside `_ALPHABET` (emoji, CJK, ...) are <unk> pieces and become tokens of their own. A paragraph
  longer than ~390 word pieces goes through trankit's own chunking, which can cut a word at a chunk boundary
  (offsets stay right). Each token dict has 'dspan' with text[dspan[0]:dspan[1]] == token['text'].
* Tags are meaningless: UPOS/XPOS/FEATS/heads/deprels/NER come from random heads. Every word gets a UPOS from
  FAKE_UPOS, an XPOS from FAKE_XPOS and a deprel from FAKE_DEPREL (the '_' slot that trankit's vocab must
  hold is never predicted for those three); FEATS may be '_' and is then left out of the token dict, as
  trankit leaves out every '_' value.
* The lemmatizer always keeps the word (its edit classifier always answers 'identity').

Tests can therefore check wiring (character offsets, UPOS filtering, offline operation), not linguistics.

Offline: transformers and huggingface_hub read HF_HUB_OFFLINE when they are imported. The builder calls
`force_hf_offline()`, which sets HF_HUB_OFFLINE=1 and TRANSFORMERS_OFFLINE=1 and also flips the flags in the
already-imported modules, so `from_pretrained` reads the cache without touching the network (without it, each
load retries DNS for minutes where there is no network). Pass `offline=False` to leave the process alone.

Trankit prints its progress to stdout with print(); `contextlib.redirect_stdout(io.StringIO())` silences it
(see `quiet()`).
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import random
from pathlib import Path

LANG = "english"
EMBEDDING = "xlm-roberta-base"
FAKE_REVISION = "0" * 40  # the snapshot name in the fake hub cache

FAKE_UPOS = ("ADJ", "ADP", "ADV", "AUX", "CCONJ", "DET", "INTJ", "NOUN", "NUM", "PART", "PRON", "PROPN",
             "PUNCT", "SCONJ", "SYM", "VERB", "X")
"""Every UPOS the fake tagger can emit (all 17 UD tags); each word gets one of them, at random."""
FAKE_XPOS = ("CC", "CD", "DT", "IN", "JJ", "MD", "NN", "NNP", "NNS", "PRP", "RB", "TO", "VB", "VBD", "VBZ",
             "WRB", ".", ",")
FAKE_FEATS = ("Number=Sing", "Number=Plur", "Definite=Def|PronType=Art", "Mood=Ind|Tense=Past|VerbForm=Fin",
              "Case=Nom|Person=3|PronType=Prs")
"""FEATS values besides '_' (which trankit drops from the token dict)."""
FAKE_DEPREL = ("root", "nsubj", "obj", "iobj", "obl", "advmod", "amod", "det", "case", "nmod", "compound",
               "flat", "punct", "aux", "cop", "mark", "cc", "conj", "nummod", "acl", "advcl", "xcomp", "appos",
               "dep")
FAKE_NER_TYPES = ("PERSON", "GPE", "ORG", "DATE")
SENTENCE_FINAL = (".", "?", "!")

_SEED = 1234
_HIDDEN = 768  # trankit: xlmr_dim = 768 for xlm-roberta-base
_INTERMEDIATE = 32
_MAX_POSITIONS = 514
# layout of the hand-set hidden dimensions of the fake XLM-R layer
_D_START, _D_FINAL, _D_NEXT_START, _D_NEXT_FINAL, _D_POS = 0, 1, 2, 3, 4
_D_RANDOM = _D_POS + _MAX_POSITIONS  # 518..767: random features of each piece, for the taggers
_ALPHABET = ("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
             "!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~"
             "’‘“”—–…«»¿¡€£°§©"
             "éèêëáàâäãåíìîïóòôöõúùûüýÿñçøæœßÉÈÊËÁÀÂÄÍÎÓÔÖÚÜÑÇØÆ")


def force_hf_offline() -> None:
    """Make huggingface_hub/transformers load from the local cache only (the library's own switch)."""
    from pipeline.attribution.tagging import hub_offline

    hub_offline()


@contextlib.contextmanager
def quiet():
    """Swallow what trankit prints (it uses print(), so redirecting sys.stdout is enough)."""
    with contextlib.redirect_stdout(io.StringIO()):
        yield


def _sentences(rng: random.Random, n: int = 400) -> list[str]:
    first = ["Ana", "Bell", "Tom", "Mira", "John", "Lena", "Omar", "Sara", "Ivan", "Kate", "Marco", "Yuki"]
    last = ["Smith", "Varo", "Novak", "Chen", "Garcia", "Olsen", "Brown", "Kim", "Rossi", "Dubois"]
    places = ["Paris", "Varo", "London", "Lisbon", "Oslo", "Cairo", "Lima", "Berlin", "Quito", "Dublin"]
    nouns = ["book", "city", "novel", "house", "prize", "river", "school", "garden", "letter", "song", "story"]
    adjs = ["old", "famous", "small", "quiet", "new", "first", "long", "strange", "happy", "dark"]
    verbs = ["wrote", "lives", "was born", "moved", "studied", "works", "found", "loves", "visited", "sold"]
    templates = [
        "{f} {l} {v} in {p} .", "Where was {f} {l} born ?", "The {a} {n} is in {p} .",
        "{f} {v} a {a} {n} in {y} .", "Did {f} write the {n} ?", "She lives in {p} , near the {n} .",
        "He {v} {k} {n}s and {k} {n}s !", "What is the name of the {n} ?", "In {y} , {f} {l} won the {a} prize .",
        "\" I {v} it , \" said {f} .", "They were ( as always ) in {p} ; the {n} was {a} .",
        "{f}'s {n} costs ${k}.50 - or {k}% less .", "It's {a} : {f} and {l} ... maybe !",
    ]
    out = []
    for _ in range(n):
        t = rng.choice(templates)
        out.append(t.format(f=rng.choice(first), l=rng.choice(last), p=rng.choice(places), n=rng.choice(nouns),
                            a=rng.choice(adjs), v=rng.choice(verbs), y=rng.randint(1900, 2024),
                            k=rng.randint(2, 99)))
    return out


def _train_sentencepiece(rng: random.Random, split) -> bytes:
    import sentencepiece as spm

    # Train on text split the way trankit splits it before word-piecing (whitespace and punctuation), and
    # force a "▁x" piece for each character, so the first piece of every pseudo-token starts with "▁".
    lines = [" ".join(split(s)) for s in _sentences(rng)]
    lines += [" ".join(_ALPHABET), " ".join("a" + c for c in _ALPHABET)] * 3  # every char, word-initial or not
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=model, model_type="unigram", vocab_size=600,
        hard_vocab_limit=False, character_coverage=1.0, normalization_rule_name="identity",
        user_defined_symbols=["\u2581" + c for c in _ALPHABET], seed_sentencepiece_size=5000,
        num_threads=1, minloglevel=2,
    )
    return model.getvalue()


def _write_hub_snapshot(emb_dir: Path, sp_model: bytes) -> Path:
    """The files XLMRobertaTokenizer/XLMRobertaModel.from_pretrained('xlm-roberta-base') read, hub layout."""
    repo = emb_dir / f"models--{EMBEDDING}"
    snap = repo / "snapshots" / FAKE_REVISION
    snap.mkdir(parents=True, exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(FAKE_REVISION)
    (snap / "sentencepiece.bpe.model").write_bytes(sp_model)
    (snap / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "XLMRobertaTokenizer", "model_max_length": 512, "bos_token": "<s>",
        "eos_token": "</s>", "sep_token": "</s>", "cls_token": "<s>", "unk_token": "<unk>",
        "pad_token": "<pad>", "mask_token": "<mask>"}))
    (snap / "special_tokens_map.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>", "sep_token": "</s>", "cls_token": "<s>", "unk_token": "<unk>",
        "pad_token": "<pad>", "mask_token": "<mask>"}))
    return snap


def _build_xlmr(snap: Path, gen) -> None:
    """A 1-layer XLM-R whose hidden state at piece i tells whether piece i+1 starts a pseudo-token."""
    import torch
    from transformers import XLMRobertaConfig, XLMRobertaModel, XLMRobertaTokenizer

    tok = XLMRobertaTokenizer.from_pretrained(str(snap))
    vocab = len(tok)
    config = XLMRobertaConfig(
        vocab_size=vocab, hidden_size=_HIDDEN, num_hidden_layers=1, num_attention_heads=1,
        intermediate_size=_INTERMEDIATE, max_position_embeddings=_MAX_POSITIONS, type_vocab_size=1,
        pad_token_id=1, bos_token_id=0, eos_token_id=2, layer_norm_eps=1e-5,
    )
    model = XLMRobertaModel(config)
    flag = 8.0
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        emb = model.embeddings
        words = torch.zeros(vocab, _HIDDEN)
        words[:, _D_RANDOM:] = torch.randn(vocab, _HIDDEN - _D_RANDOM, generator=gen)
        for i in range(vocab):
            piece = tok.convert_ids_to_tokens(i)
            if i in (tok.unk_token_id, tok.eos_token_id) or (piece.startswith("\u2581") and piece != "\u2581"):
                words[i, _D_START] = flag
            if piece.lstrip("\u2581") in SENTENCE_FINAL:
                words[i, _D_FINAL] = flag
        emb.word_embeddings.weight.copy_(words)
        positions = torch.arange(_MAX_POSITIONS)
        emb.position_embeddings.weight[positions, _D_POS + positions] = flag
        emb.LayerNorm.weight.fill_(1.0)

        layer = model.encoder.layer[0]
        att = layer.attention.self
        pos = torch.arange(_MAX_POSITIONS - 1)
        # query of position p looks for the key of position p+1 (hard attention after softmax)
        att.query.weight[_D_POS + 1 + pos, _D_POS + pos] = 12.0
        att.key.weight[_D_POS + pos, _D_POS + pos] = 1.0
        att.value.weight[_D_NEXT_START, _D_START] = 1.0
        att.value.weight[_D_NEXT_FINAL, _D_FINAL] = 1.0
        out = layer.attention.output
        out.dense.weight[_D_NEXT_START, _D_NEXT_START] = 1.0
        out.dense.weight[_D_NEXT_FINAL, _D_NEXT_FINAL] = 1.0
        out.LayerNorm.weight.fill_(1.0)
        layer.intermediate.dense.weight.normal_(0, 0.02, generator=gen)
        layer.output.LayerNorm.weight.fill_(1.0)  # the feed-forward output stays 0: the layer passes h on
        model.pooler.dense.weight.normal_(0, 0.02, generator=gen)
    model.half().save_pretrained(str(snap), safe_serialization=True)
    cfg = json.loads((snap / "config.json").read_text())
    cfg.pop("torch_dtype", None)
    cfg.pop("dtype", None)
    (snap / "config.json").write_text(json.dumps(cfg, indent=2))


def _trankit_config(cache_dir: Path, vocabs: dict, ner_vocab: dict):
    import torch
    from trankit.config import Config

    config = Config()
    config.embedding_name = EMBEDDING
    config._cache_dir = str(cache_dir)
    config.device = torch.device("cpu")
    config.training = True  # trankit's classes then skip loading the (not yet written) weights
    config.vocabs = {"UD_English-EWT": vocabs}
    config.ner_vocabs = {LANG: ner_vocab}
    return config


def _adapter_state(config, task: str, head, gen) -> dict:
    """What trankit's TPipeline._save_model writes: the trainable task-adapter weights plus the head's."""
    import torch
    from trankit.models.base_models import Multilingual_Embedding

    emb = Multilingual_Embedding(config, model_name=task)
    state = {}
    with torch.no_grad():
        for name, p in emb.named_parameters():
            if p.requires_grad:
                if "adapter_up" in name:
                    p.zero_()  # the adapter adds nothing: the hand-set hidden states reach the heads intact
                state[name] = p.detach().clone().half()
        for name, value in head.state_dict().items():
            state[name] = value.detach().clone().half() if value.is_floating_point() else value.clone()
    return {"adapters": state, "epoch": 0}


def _vocabs() -> dict:
    def index(labels):
        return {label: i for i, label in enumerate(("_",) + tuple(labels))}

    return {
        "lemma": {"0": 0},
        "upos": index(FAKE_UPOS), "xpos": index(FAKE_XPOS), "feats": index(FAKE_FEATS),
        "head": {"_": 0}, "deprel": index(FAKE_DEPREL), "deps": {"_": 0},
    }


def _ner_vocab() -> dict:
    labels = ["O"] + [f"{b}-{t}" for t in FAKE_NER_TYPES for b in "BIES"]
    return {label: i for i, label in enumerate(labels)}


def _lemmatizer_checkpoint(gen) -> dict:
    import torch
    from trankit.layers.seq2seq import Seq2SeqModel
    from trankit.models.lemma_model import get_args
    from trankit.utils.mwt_lemma_utils.seq2seq_utils import EDIT_TO_ID, VOCAB_PREFIX
    from trankit.utils.mwt_lemma_utils.seq2seq_vocabs import MultiVocab, Vocab

    char_vocab = Vocab.load_state_dict({"lang": LANG, "idx": 0, "cutoff": 0, "lower": False,
                                        "_id2unit": list(VOCAB_PREFIX) + list(_ALPHABET)})
    char_vocab._unit2id = {u: i for i, u in enumerate(char_vocab._id2unit)}
    pos_vocab = Vocab.load_state_dict({"lang": LANG, "idx": 0, "cutoff": 0, "lower": False,
                                       "_id2unit": list(VOCAB_PREFIX) + list(FAKE_UPOS)})
    pos_vocab._unit2id = {u: i for i, u in enumerate(pos_vocab._id2unit)}
    vocab = MultiVocab({"char": char_vocab, "pos": pos_vocab})

    args = get_args()
    args.update(lang=LANG, hidden_dim=16, emb_dim=8, pos_dim=8, max_dec_len=8,
                vocab_size=char_vocab.size, pos_vocab_size=pos_vocab.size)
    model = Seq2SeqModel(args)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.1, generator=gen)
        model.edit_clf[-1].bias.fill_(-10.0)
        model.edit_clf[-1].bias[EDIT_TO_ID["identity"]] = 10.0  # lemma = the word itself
    return {"model": model.state_dict(), "dicts": ({}, {}), "vocab": vocab.state_dict(), "config": args}


def build_fake_trankit_cache(cache_dir: Path, *, offline: bool = True) -> Path:
    """Write a random-weight Trankit cache for English under `cache_dir`; return `cache_dir`.

    Use it as `trankit.Pipeline('english', cache_dir=str(cache_dir), gpu=False)`. With `offline` (the default)
    this process is switched to Hugging Face offline mode first (`force_hf_offline()`); otherwise the caller
    must set HF_HUB_OFFLINE=1 before importing transformers, or every load will wait on the network.
    """
    if offline:
        force_hf_offline()
    from pipeline.attribution.trankit_compat import import_trankit

    import_trankit()
    import torch
    from trankit.utils.tokenizer_utils import split_to_substrings

    cache_dir = Path(cache_dir)
    emb_dir = cache_dir / EMBEDDING
    lang_dir = emb_dir / LANG
    lang_dir.mkdir(parents=True, exist_ok=True)
    rng = random.Random(_SEED)
    gen = torch.Generator().manual_seed(_SEED)

    snap = _write_hub_snapshot(emb_dir, _train_sentencepiece(rng, split_to_substrings))
    _build_xlmr(snap, gen)

    vocabs, ner_vocab = _vocabs(), _ner_vocab()
    (lang_dir / f"{LANG}.vocabs.json").write_text(json.dumps(vocabs))
    (lang_dir / f"{LANG}.ner-vocab.json").write_text(json.dumps(ner_vocab))
    config = _trankit_config(cache_dir, vocabs, ner_vocab)

    adapters_log = logging.getLogger("adapters.model_mixin")  # "adapters available but none are activated"
    log_level = adapters_log.level
    adapters_log.setLevel(logging.ERROR)
    try:
        _write_task_models(config, lang_dir, gen)
    finally:
        adapters_log.setLevel(log_level)
    (lang_dir / f"{LANG}.downloaded").write_text("")
    return cache_dir


def _write_task_models(config, lang_dir: Path, gen) -> None:
    import torch
    from trankit.models.classifiers import NERClassifier, PosDepClassifier, TokenizerClassifier

    with quiet(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(_SEED)
        tokenizer = TokenizerClassifier(config, treebank_name="UD_English-EWT")
        with torch.no_grad():
            ffn = tokenizer.tokenizer_ffn  # labels: 0 inside a token, 1 token end, 2 sentence end, 3/4 MWT
            ffn.weight.zero_()
            ffn.bias.copy_(torch.tensor([4.0, 0.0, -4.0, -1e4, -1e4]))
            ffn.weight[1, _D_NEXT_START] = 1.0
            ffn.weight[2, _D_NEXT_START] = 1.0
            ffn.weight[2, _D_FINAL] = 1.0
            ffn.weight[2, _D_NEXT_FINAL] = -2.0
        torch.save(_adapter_state(config, "tokenizer", tokenizer, gen), lang_dir / f"{LANG}.tokenizer.mdl")

        tagger = PosDepClassifier(config, treebank_name="UD_English-EWT")
        with torch.no_grad():
            for name, p in tagger.named_parameters():
                if "pairwise_weight" in name or ("ffn" in name and name.endswith("weight")):
                    p.normal_(0, 0.05, generator=gen)
            for ffn in (tagger.upos_ffn, tagger.xpos_ffn):
                ffn.bias[0] = -1e4  # never '_'
            # Deep_Biaffine reads its weight through a reshape: label 0's constant term (ones x ones) sits at
            # flat position [in_dim1, 0 * (in_dim2 + 1) + in_dim2], not at [-1, -1, 0]
            biaffine = tagger.deprel
            biaffine.pairwise_weight.view(biaffine.in_dim1 + 1, -1)[-1, biaffine.in_dim2] = -1e4  # never '_'
        torch.save(_adapter_state(config, "tagger", tagger, gen), lang_dir / f"{LANG}.tagger.mdl")

        ner = NERClassifier(config, LANG)
        torch.save(_adapter_state(config, "ner", ner, gen), lang_dir / f"{LANG}.ner.mdl")

        torch.save(_lemmatizer_checkpoint(gen), lang_dir / f"{LANG}_lemmatizer.pt")
