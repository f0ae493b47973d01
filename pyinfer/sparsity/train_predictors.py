"""Train activation predictors: per FFN layer a small MLP `x -> relu(fc1 x) -> fc2 . + bias` (d -> r -> n_ff)
whose positive outputs mark the neurons expected active (|h| > t_l) for FFN input x.

Training (numpy, Adam): binary cross-entropy where a missed active neuron costs its activation mass
(|h| / mean active |h|) and a false alarm costs 1. The weights are then rounded to float16 (as stored)
and the bias shifted on calibration chunks so that the predicted set covers `--recall` (0.99) of the
active mass. Rank per layer: ranks are tried smallest first, keeping the one with the fewest bytes read per
token (predictor + predicted FFN rows), stopping once a larger rank costs more. Reported metrics are
measured on test chunks that neither training nor calibration saw (every 10th chunk; calibration uses
chunks 4, 14, ...).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
from scipy.special import expit
from tqdm import tqdm

from pyinfer.console import run_cli
from pyinfer.errors import InvalidArgumentError
from pyinfer.formats.gguf_file import GGUFFile
from pyinfer.sparsity.profiler import add_profile_args, layer_table, profile_from_args, stats_of

RANKS = (16, 32, 64, 128, 256)
RECALL = 0.99
EPOCHS = 6
BATCH = 256
LR = 3e-3


@dataclass
class Predictor:
    """Stored form: fc1 (rank, n_embd) and fc2 (n_ff, rank) hold float16 values, bias (n_ff,) float32."""

    fc1: np.ndarray
    fc2: np.ndarray
    bias: np.ndarray

    @property
    def rank(self) -> int:
        return self.fc1.shape[0]

    @property
    def params(self) -> int:
        return self.fc1.size + self.fc2.size + self.bias.size

    def logits(self, x: np.ndarray) -> np.ndarray:
        """(n, n_embd) -> (n, n_ff); active where > 0."""
        hidden = np.maximum(x.astype(np.float32) @ self.fc1.T.astype(np.float32), 0.0)  # (n, rank)
        return hidden @ self.fc2.T.astype(np.float32) + self.bias

    def permuted(self, perm: np.ndarray) -> Predictor:
        """The same predictor for neurons stored in order `perm` (new neuron i = old neuron perm[i])."""
        return Predictor(self.fc1, self.fc2[perm], self.bias[perm])


@dataclass
class Metrics:
    recall: float  # active mass (sum |h| over |h| > t) inside the predicted set / all active mass
    precision: float  # predicted neurons that are active / predicted neurons
    density: float  # predicted neurons / all neurons
    true_density: float  # active neurons / all neurons


def evaluate(pred: Predictor, x: np.ndarray, a: np.ndarray, t: float) -> Metrics:
    """Metrics of pred on x (n, n_embd) against a = |h| (n, n_ff) with threshold t."""
    hit = pred.logits(x) > 0  # (n, n_ff)
    active = a > t  # (n, n_ff)
    mass = np.where(active, a, 0.0)
    total = float(mass.sum(dtype=np.float64))
    n_hit = int(hit.sum())
    return Metrics(recall=float(mass[hit].sum(dtype=np.float64)) / total if total > 0 else 1.0,
                   precision=float((hit & active).sum()) / n_hit if n_hit else 1.0,
                   density=float(hit.mean()), true_density=float(active.mean()))


def split(chunk_of_token: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Boolean token masks (train, calibration, test) by chunk: chunks 9, 19, ... test; 4, 14, ... calibration."""
    if chunk_of_token.max(initial=0) < 9:
        raise InvalidArgumentError("predictor training needs at least 10 chunks (raise --tokens or lower --ctx)")
    test = chunk_of_token % 10 == 9
    calib = chunk_of_token % 10 == 4
    return ~(test | calib), calib, test


def fit(x: np.ndarray, a: np.ndarray, t: float, rank: int, *, epochs: int = EPOCHS, batch: int = BATCH,
        lr: float = LR, seed: int = 0) -> Predictor:
    """Train one predictor on x (n, n_embd), a = |h| (n, n_ff); float32 weights, bias not yet calibrated."""
    rng = np.random.default_rng(seed)
    n, d = x.shape
    n_ff = a.shape[1]
    shuffle = rng.permutation(n)  # once: batches are then contiguous slices (views), visited in random order
    x, a = x[shuffle], a[shuffle]
    active = a > t  # (n, n_ff)
    mean_mass = float(a[active].mean()) if active.any() else 1.0
    weight = np.where(active, a / mean_mass, 1.0).astype(np.float32)  # (n, n_ff) cost of a wrong answer
    target = np.where(active, weight, 0.0).astype(np.float32)  # (n, n_ff) weight * label
    scale = (1.0 / np.sqrt(np.mean(x * x, axis=0) + 1e-12)).astype(np.float32)  # (d,) inputs to unit RMS
    xs = (x * scale).astype(np.float32)  # (n, d)
    freq = np.clip(active.mean(axis=0), 1e-4, 1 - 1e-4)
    params = {
        "w1": (rng.standard_normal((rank, d)) / np.sqrt(d)).astype(np.float32),  # (rank, d)
        "w2": (rng.standard_normal((n_ff, rank)) * 0.1 / np.sqrt(rank)).astype(np.float32),  # (n_ff, rank)
        "b": np.log(freq / (1 - freq)).astype(np.float32),  # (n_ff,) start at each neuron's base rate
    }
    m = {k: np.zeros_like(v) for k, v in params.items()}
    v = {k: np.zeros_like(p) for k, p in params.items()}
    steps = epochs * -(-n // batch)
    step = 0
    for _ in range(epochs):
        for start in rng.permutation(np.arange(0, n, batch)):
            idx = slice(start, start + batch)
            xb = xs[idx]  # (B, d)
            pre = xb @ params["w1"].T  # (B, rank)
            hid = np.maximum(pre, 0.0)
            z = hid @ params["w2"].T + params["b"]  # (B, n_ff)
            gz = (weight[idx] * expit(z) - target[idx]) / len(xb)  # (B, n_ff) d loss / d z
            gh = (gz @ params["w2"]) * (pre > 0)  # (B, rank)
            grads = {"w1": gh.T @ xb, "w2": gz.T @ hid, "b": gz.sum(axis=0)}
            step += 1
            rate = lr * (0.1 + 0.9 * 0.5 * (1 + np.cos(np.pi * step / steps)))  # cosine decay to lr/10
            for k, g in grads.items():
                m[k] = 0.9 * m[k] + 0.1 * g
                v[k] = 0.999 * v[k] + 0.001 * g * g
                m_hat = m[k] / (1 - 0.9 ** step)
                v_hat = v[k] / (1 - 0.999 ** step)
                params[k] -= (rate * m_hat / (np.sqrt(v_hat) + 1e-8)).astype(np.float32)
    return Predictor(params["w1"] * scale, params["w2"], params["b"])


def calibrate(pred: Predictor, x: np.ndarray, a: np.ndarray, t: float, recall: float = RECALL) -> Predictor:
    """pred with float16 weights and the bias shifted so the predicted set keeps `recall` of the active
    mass of (x, a): the lowest-scoring active neurons are dropped while their mass fits the budget."""
    stored = Predictor(pred.fc1.astype(np.float16), pred.fc2.astype(np.float16), pred.bias.astype(np.float32))
    z = stored.logits(x)  # (n, n_ff)
    active = a > t
    zp, mp = z[active], a[active].astype(np.float64)  # scores and masses of the active pairs
    if zp.size == 0:
        return stored
    order = np.argsort(zp, kind="stable")
    zs, cum = zp[order], np.cumsum(mp[order])
    k = int(np.searchsorted(cum, (1.0 - recall) * cum[-1], side="right"))  # may drop zs[:k]
    if k < zs.size:
        k = int(np.searchsorted(zs, zs[k], side="left"))  # never split a group of equal scores
    zs = zs.astype(np.float64)
    cut = zs[0] - 1.0 if k == 0 else (zs[k - 1] + zs[k]) / 2 if k < zs.size else zs[-1]
    return Predictor(stored.fc1, stored.fc2, (stored.bias - np.float32(cut)).astype(np.float32))


@dataclass
class LayerResult:
    predictor: Predictor
    metrics: Metrics  # on the test chunks
    tried: list[dict] = field(default_factory=list)  # per rank: density on calibration, cost in bytes


def train_layer(x: np.ndarray, a: np.ndarray, t: float, masks: tuple[np.ndarray, np.ndarray, np.ndarray],
                cost: Callable[[int, float], float], *, ranks: tuple[int, ...] = RANKS, recall: float = RECALL,
                epochs: int = EPOCHS, seed: int = 0) -> LayerResult:
    """Rank search for one layer (see the module docstring); cost(rank, density) is bytes read per token."""
    train, calib, test = masks
    if not ranks:
        raise InvalidArgumentError("no ranks to try")
    best: tuple[float, Predictor] | None = None
    tried = []
    for rank in sorted(ranks):
        pred = calibrate(fit(x[train], a[train], t, rank, epochs=epochs, seed=seed), x[calib], a[calib], t, recall)
        density = evaluate(pred, x[calib], a[calib], t).density
        c = cost(rank, density)
        tried.append({"rank": rank, "density": density, "cost": c})
        if best is not None and c >= best[0]:
            break
        best = (c, pred)
    return LayerResult(best[1], evaluate(best[1], x[test], a[test], t), tried)  # type: ignore[index]


def cost_model(g: GGUFFile, il: int) -> Callable[[int, float], float]:
    """Bytes read per token by layer il's sparse FFN: float16 predictor plus the predicted rows of
    ffn_up, ffn_gate and ffn_down_t (each neuron's row in the file's own type)."""
    cfg = g.config
    names = [f"blk.{il}.{n}.weight" for n in ("ffn_up", "ffn_gate", "ffn_down_t")]
    row_bytes = sum(g.tensors[n].data.nbytes for n in names if n in g.tensors) / cfg.n_ff
    return lambda rank, density: 2 * rank * (cfg.n_embd + cfg.n_ff) + 4 * cfg.n_ff + density * cfg.n_ff * row_bytes


def report_row(il: int, t: float, res: LayerResult) -> dict:
    m = res.metrics
    return {"layer": il, "threshold": t, "rank": res.predictor.rank, "params": res.predictor.params,
            "recall": m.recall, "precision": m.precision, "density": m.density, "true_density": m.true_density}


def parse_ranks(text: str) -> tuple[int, ...]:
    try:
        ranks = tuple(int(r) for r in text.split(","))
    except ValueError:
        raise InvalidArgumentError(f"--ranks takes comma-separated integers, not {text!r}") from None
    if not ranks or min(ranks) < 1:
        raise InvalidArgumentError(f"--ranks must be positive integers, not {text!r}")
    return ranks


def add_training_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ranks", default=",".join(map(str, RANKS)), help=f"ranks to try (default {RANKS})")
    p.add_argument("--recall", type=float, default=RECALL,
                   help=f"activation-mass recall the bias is calibrated to (default {RECALL})")
    p.add_argument("--epochs", type=int, default=EPOCHS, help=f"training epochs per rank (default {EPOCHS})")


def write_json(path: str, doc: dict) -> None:
    part = path + ".part"
    with open(part, "w") as f:
        json.dump(doc, f, indent=1)
    os.replace(part, path)


def _train(args: argparse.Namespace) -> int:
    path, profile, calibration = profile_from_args(args)
    if not 0.0 < args.recall <= 1.0:
        raise InvalidArgumentError(f"--recall must be in (0, 1], not {args.recall}")
    ranks = parse_ranks(args.ranks)
    g = GGUFFile(path)
    masks = split(profile.chunk_of_token())
    arrays, rows = {}, []
    for il in tqdm(range(profile.n_layer), desc="training", file=sys.stderr, disable=None):
        x, h = profile.layer(il)
        a = np.abs(h)
        t = stats_of(a, args.sparsity, profile.kind).threshold
        res = train_layer(x, a, t, masks, cost_model(g, il), ranks=ranks, recall=args.recall, epochs=args.epochs)
        arrays |= {f"fc1.{il}": res.predictor.fc1, f"fc2.{il}": res.predictor.fc2,
                   f"fc2_bias.{il}": res.predictor.bias, f"threshold.{il}": np.float32(t)}
        rows.append(report_row(il, t, res) | {"tried": res.tried})
    print(layer_table([{k: v for k, v in r.items() if k != "tried"} for r in rows]))
    part = args.output + ".part"
    with open(part, "wb") as f:
        np.savez(f, **arrays)
    os.replace(part, args.output)
    write_json(os.path.splitext(args.output)[0] + ".json",
               {"model": path, "calibration": calibration, "kind": profile.kind, "layers": rows})
    print(f"wrote {args.output}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pyinfer train-predictors", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_profile_args(p)
    add_training_args(p)
    p.add_argument("-o", "--output", required=True,
                   help="predictor weights .npz (neurons in the model's current order); a .json report is "
                   "written next to it")
    return run_cli("pyinfer train-predictors", p, _train, argv)


if __name__ == "__main__":
    sys.exit(main())
