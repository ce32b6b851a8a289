"""Measure the generated stand-in data sets, at the sizes of the committed GPU runs, beside the
real data sets' published figures.

    python3 tools/stand_in_data.py                 # full size (a few minutes on 2 CPU cores)
    python3 tools/stand_in_data.py --quick         # the sizes the demo runs on

Writes one record per (data set, statistic) (:mod:`effdl.data.stand_in`) to
``<out>/task1/stand_in_data.jsonl`` (the Carvana-like set of train_unet.py and the sample of
standard-library paragraphs lm_precision.py trains on, against WikiText-103's lines),
``<out>/task2/stand_in_data.jsonl`` (the WikiText-103-like corpus of the batching runs) and
``<out>/vit/stand_in_data.jsonl`` (the Clothing-like set of the ViT runs).
Each data set is made as its task's script makes it (same settings and seed) and named in
``config.source`` as that script's logs name it. Token counts use basic_english, as the runs.
The paragraphs depend on the Python installation: run this where lm_precision.py ran.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from effdl.cli import ArgumentParser, require_writable_folder, run_main
from effdl.data import clothing, corpus, images
from effdl.data.lm_batches import text_samples
from effdl.data.stand_in import NOT_PUBLISHED
from effdl.data.stdlib_text import DEFAULT_CACHE
from effdl.data.tokenize import basic_english_many
from effdl.results import RunLog
from effdl.vit_pipeline.config import PRESETS

TASKS = ("task1", "task2", "vit")
MERITY = "Merity et al. 2016"
MERITY_TOKENS = f"{MERITY} (their tokenization, not basic_english)"
MERITY_WORDS = f"{MERITY} (their tokenization)"
PER_ARTICLE = f"{MERITY}: tokens / articles, their tokenization"
VOCAB = f"{MERITY} (words seen 3+ times, case kept)"
SAMPLE = "not comparable (the run uses a sample of the lines)"


@dataclass(frozen=True)
class Sizes:
    """The settings of the runs whose data is measured (the scripts' defaults, or --quick's)."""

    carvana: images.SyntheticCarvanaConfig  # train_unet.py: --n-images, seed 0
    unet_size: int  # train_unet.py --size: the masks the UNet sees
    lm_samples: int  # lm_precision.py --n-samples
    lm_max_length: int  # lm_precision.py --max-length
    corpus_quick: bool  # the batching scripts' corpus: quick, or WikiText-103 size
    corpus_max_length: int  # BRAIN's padded length
    vit: tuple[int, int, int]  # task3 --n-images, --min-side, --max-side


def vit_sizes(quick: bool) -> tuple[int, int, int]:
    cfg = PRESETS["fixed"][quick]
    return cfg.n_images, cfg.min_side, cfg.max_side


FULL = Sizes(images.SyntheticCarvanaConfig(n_images=5088), 256, 30_000, 256, False, 640,
             vit_sizes(False))  # fmt: skip
QUICK = Sizes(images.SyntheticCarvanaConfig(n_images=40), 64, 2_500, 64, True, 128,
              vit_sizes(True))  # fmt: skip


class StatLog:
    """One data set's records: ``add`` logs a statistic with its published figure (or None)."""

    def __init__(self, log: RunLog, data_set: str, real: str, source: str, **settings) -> None:
        self.log, self.config = log, {"data_set": data_set, "stand_in_for": real,
                                      "source": source, "settings": settings}  # fmt: skip

    def add(self, key: str, statistic: str, unit: str, measured: float,
            published: float | None = None, note: str = NOT_PUBLISHED) -> None:  # fmt: skip
        config = {**self.config, "statistic": statistic, "unit": unit, "published_note": note}
        metrics = {"measured": measured, "published": published}
        self.log.log(f"{self.config['data_set']}/{key}", config, metrics)


def log_corpus(stats: StatLog, s: corpus.CorpusStats, whole_split: bool, long: tuple[int, ...]):
    """The corpus's lengths; totals are compared only where the corpus is a whole split."""
    real = lambda figure, note: (figure, note) if whole_split else (None, SAMPLE)  # noqa: E731
    words, tokens = int(s.line_words.sum()), int(s.line_tokens.sum())
    real_tokens = corpus.WIKITEXT103_TRAIN_TOKENS
    if whole_split:
        stats.add("lines", "lines, blank ones included", "count", s.n_lines,
                  corpus.WIKITEXT103_TRAIN_LINES, MERITY)  # fmt: skip
    stats.add("samples", "non-empty lines (samples)", "count", s.n_samples)
    stats.add("articles", "articles", "count", s.n_articles,
              *real(corpus.WIKITEXT103_TRAIN_ARTICLES, MERITY))  # fmt: skip
    stats.add("tokens", "tokens, basic_english", "tokens", tokens,
              *real(real_tokens, MERITY_TOKENS))  # fmt: skip
    stats.add("words", "tokens, whitespace-separated", "tokens", words,
              *real(real_tokens, MERITY_WORDS))  # fmt: skip
    stats.add("vocabulary", "distinct basic_english tokens", "count", s.vocabulary,
              *real(corpus.WIKITEXT103_VOCAB, VOCAB))  # fmt: skip
    if whole_split:
        stats.add("words_per_line", "whitespace tokens per line, blank lines included", "tokens",
                  words / s.n_lines, real_tokens / corpus.WIKITEXT103_TRAIN_LINES,
                  f"{MERITY}: tokens / lines")  # fmt: skip
    log_sample_lengths(stats, s, long)
    per_article = real_tokens / corpus.WIKITEXT103_TRAIN_ARTICLES
    stats.add("article_tokens_mean", "tokens per article, mean (basic_english)", "tokens",
              float(s.article_lengths().mean()), per_article, PER_ARTICLE)  # fmt: skip
    stats.add("article_words_mean", "whitespace tokens per article, mean", "tokens",
              float(s.article_lengths(words=True).mean()), per_article,
              PER_ARTICLE)  # fmt: skip


def log_sample_lengths(stats: StatLog, s: corpus.CorpusStats, long: tuple[int, ...]) -> None:
    """Percentiles and maximum of the tokens per sample, and the share longer than each of
    ``long``."""
    for q, v in zip((50, 90, 99), np.percentile(s.line_tokens, (50, 90, 99)), strict=True):
        stats.add(f"line_tokens_p{q}", f"tokens per sample, {q}th percentile", "tokens", float(v))
    stats.add("line_tokens_max", "tokens per sample, max", "tokens", int(s.line_tokens.max()))
    for n in long:
        stats.add(f"share_over_{n}", f"samples over {n} tokens", "share", s.share_longer(n))


def log_paragraphs(stats: StatLog, s: corpus.CorpusStats, long: tuple[int, ...]) -> None:
    """A sample of paragraphs standing in for WikiText lines: their count and lengths, the mean
    against WikiText-103's tokens per line (blank lines included, as published)."""
    stats.add("samples", "paragraphs (samples)", "count", s.n_samples)
    stats.add("tokens", "tokens, basic_english", "tokens", int(s.line_tokens.sum()), None, SAMPLE)
    stats.add("words_per_sample", "whitespace tokens per sample, mean", "tokens",
              float(s.line_words.mean()),
              corpus.WIKITEXT103_TRAIN_TOKENS / corpus.WIKITEXT103_TRAIN_LINES,
              f"{MERITY}: tokens / lines, blank lines included")  # fmt: skip
    log_sample_lengths(stats, s, long)


def measure_task1(out: Path, sizes: Sizes, workers: int | None, cache: Path) -> None:
    log = RunLog(out / "task1" / "stand_in_data.jsonl", "stand_in_data", create=True)
    cfg = sizes.carvana
    stats = StatLog(log, "carvana_like", "Carvana Image Masking Challenge, train",
                    f"synthetic:{cfg.n_images}", **asdict(cfg))  # fmt: skip
    fractions = np.array(list(tqdm(
        images.synthetic_mask_fractions(cfg, (None, sizes.unet_size), workers),
        total=cfg.n_images, desc="Carvana-like masks", unit="image")))  # fmt: skip
    stats.add("images", "images", "count", cfg.n_images, images.CARVANA_TRAIN_IMAGES, "Kaggle")
    stats.add("cars", "cars (images / views per car)", "count", cfg.n_images / cfg.views_per_car,
              images.CARVANA_CARS, "Kaggle (16 views each)")  # fmt: skip
    stats.add("width", "image width", "px", cfg.width, images.CARVANA_WIDTH, "Kaggle")
    stats.add("height", "image height", "px", cfg.height, images.CARVANA_HEIGHT, "Kaggle")
    unet = sizes.unet_size
    for key, name, value in [("mean", "mean", fractions[:, 0].mean()),
                             ("min", "min", fractions[:, 0].min()),
                             ("max", "max", fractions[:, 0].max()),
                             (f"mean_{unet}px", f"mean at {unet} px (UNet input)",
                              fractions[:, 1].mean())]:  # fmt: skip
        stats.add(f"mask_fraction_{key}", f"car share of a mask's pixels, {name}", "share",
                  float(value))  # fmt: skip

    lines, source = text_samples(None, sizes.lm_samples, seed=0, cache_dir=cache)
    lm = StatLog(log, "stdlib_paragraphs", "WikiText-103 (raw) train lines", source,
                 n_samples=sizes.lm_samples)  # fmt: skip
    s = corpus.measure_corpus(tqdm([lines], desc="lm_precision paragraphs"), basic_english_many)
    log_paragraphs(lm, s, long=(sizes.lm_max_length, sizes.corpus_max_length))


def measure_task2(out: Path, sizes: Sizes) -> None:
    log = RunLog(out / "task2" / "stand_in_data.jsonl", "stand_in_data", create=True)
    make = (
        corpus.SyntheticCorpusConfig.quick if sizes.corpus_quick else corpus.SyntheticCorpusConfig
    )
    cfg = make(seed=0)
    source = corpus.corpus_name(None, sizes.corpus_quick, seed=0)
    stats = StatLog(log, "wikitext103_like", "WikiText-103 (raw) train", source, **asdict(cfg))
    chunk = 100_000
    chunks = tqdm(corpus.iter_wikitext_lines(cfg, chunk), total=math.ceil(cfg.n_lines / chunk),
                  desc="WikiText-like corpus", unit="chunk")  # fmt: skip
    log_corpus(stats, corpus.measure_corpus(chunks, basic_english_many), whole_split=True,
               long=(sizes.corpus_max_length,))  # fmt: skip


def measure_vit(out: Path, sizes: Sizes) -> None:
    log = RunLog(out / "vit" / "stand_in_data.jsonl", "stand_in_data", create=True)
    n, lo, hi = sizes.vit
    stats = StatLog(log, "clothing_like", "clothing-dataset-full (Kaggle)",
                    f"clothing_like:{n}:{lo}-{hi}px",  # as effdl.vit_pipeline.data names it
                    n_images=n, min_side=lo, max_side=hi, seed=0)  # fmt: skip
    labels = clothing.clothing_like_frame(n, seed=0)["label"].value_counts()
    approx = "Kaggle, approximate"
    stats.add("images", "images", "count", n, clothing.CLOTHING_IMAGES, "Kaggle")
    stats.add("labels", "labels", "count", len(labels), len(clothing.LABEL_COUNTS), "Kaggle")
    for label, real in clothing.LABEL_COUNTS.items():
        stats.add(f"count_{label}", f"images labelled {label}", "count", int(labels.get(label, 0)),
                  real, approx)  # fmt: skip
    wh = clothing.clothing_like_sizes(n, 0, lo, hi)
    for side, values in (("long", wh.max(1)), ("short", wh.min(1))):
        for q in (0, 10, 50, 90, 100):
            name = {0: "min", 100: "max"}.get(q, f"{q}th percentile")
            stats.add(f"{side}_side_p{q}", f"{side} side, {name}", "px",
                      float(np.percentile(values, q)))  # fmt: skip
    stats.add("megapixels_mean", "pixels per photo, mean", "megapixels",
              float(wh.prod(1).mean() / 1e6))  # fmt: skip


def main() -> None:
    p = ArgumentParser(description=__doc__.splitlines()[0],
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)  # fmt: skip
    p.add_argument("--out", type=Path, default=Path("runs/stand_in"), help="folder for the logs")
    p.add_argument("--quick", action="store_true", help="the demo's small sizes")
    p.add_argument("--tasks", nargs="+", choices=TASKS, default=list(TASKS), help="data sets")
    p.add_argument("--workers", type=int, default=None, help="processes (default: the CPUs)")
    p.add_argument("--cache", type=Path, default=DEFAULT_CACHE,
                   help="folder of the standard-library corpus lm_precision.py reads")  # fmt: skip
    args = p.parse_args()
    if args.workers is not None and args.workers < 1:
        p.error(f"--workers: must be at least 1, got {args.workers}")
    out = require_writable_folder(args.out, "--out")
    sizes = QUICK if args.quick else FULL
    if "task1" in args.tasks:
        measure_task1(out, sizes, args.workers, args.cache)
    if "task2" in args.tasks:
        measure_task2(out, sizes)
    if "vit" in args.tasks:
        measure_vit(out, sizes)
    print(f"stand-in statistics: {', '.join(f'{out}/{t}/stand_in_data.jsonl' for t in args.tasks)}")


if __name__ == "__main__":
    run_main(main)
