"""Fidelity metrics of a quantized graph against its float reference: SQNR, cosine similarity and the
agreement of two sets of detections. Pure numpy, so that they are easy to check on known arrays."""
from __future__ import annotations

import numpy as np


def sqnr_db(reference: np.ndarray, test: np.ndarray) -> float:
    """Signal-to-quantization-noise ratio, 10*log10(sum(ref^2) / sum((test - ref)^2)); inf when identical."""
    ref = np.asarray(reference, np.float64).ravel()
    noise = float(np.sum((np.asarray(test, np.float64).ravel() - ref) ** 2))
    signal = float(np.sum(ref ** 2))
    if noise == 0:
        return float("inf")
    if signal == 0:
        return float("-inf")
    return 10 * np.log10(signal / noise)


def cosine(reference: np.ndarray, test: np.ndarray) -> float:
    a, b = np.asarray(reference, np.float64).ravel(), np.asarray(test, np.float64).ravel()
    norms = np.linalg.norm(a) * np.linalg.norm(b)
    if norms == 0:
        return 1.0 if not a.any() and not b.any() else 0.0
    return float(a @ b / norms)


def class_scores(logits: np.ndarray, kind: str) -> np.ndarray:
    """Per-query class probabilities: 'sigmoid' (DETR with focal loss), or 'softmax_last_is_background'."""
    logits = np.asarray(logits, np.float64)
    if kind == "sigmoid":
        return 1 / (1 + np.exp(-logits))
    shifted = np.exp(logits - logits.max(-1, keepdims=True))
    return (shifted / shifted.sum(-1, keepdims=True))[..., :-1]


def detections(logits: np.ndarray, boxes: np.ndarray, kind: str, threshold: float) -> list[tuple]:
    """(label, score, box xyxy) of every query of one image whose best class score exceeds the threshold.
    logits: (queries, classes); boxes: (queries, 4) as normalised cx, cy, w, h."""
    probs = class_scores(logits, kind)
    labels, scores = probs.argmax(-1), probs.max(-1)
    cx, cy, w, h = np.asarray(boxes, np.float64).T
    xyxy = np.stack([cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2], -1)
    return [(int(labels[i]), float(scores[i]), xyxy[i]) for i in np.flatnonzero(scores > threshold)]


def iou(a: np.ndarray, b: np.ndarray) -> float:
    w = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    h = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = w * h
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return float(inter / union) if union > 0 else 0.0


def match_detections(reference: list[tuple], test: list[tuple], iou_threshold: float) -> dict:
    """Greedy matching, highest reference score first, each to the unmatched test box of the same class with
    the highest IoU at or above the threshold. Counts, so that several images can be summed."""
    unmatched = list(range(len(test)))
    ious = []
    for label, _, box in sorted(reference, key=lambda d: -d[1]):
        best, best_iou = None, iou_threshold
        for j in unmatched:
            if test[j][0] == label and (value := iou(box, test[j][2])) >= best_iou:
                best, best_iou = j, value
        if best is not None:
            unmatched.remove(best)
            ious.append(best_iou)
    return {"reference": len(reference), "test": len(test), "matched": len(ious), "iou_sum": float(sum(ious))}


def agreement(counts: dict) -> dict:
    """Precision, recall and mean IoU of summed match counts; two empty sets agree perfectly."""
    matched = counts["matched"]
    return {**counts,
            "precision": matched / counts["test"] if counts["test"] else 1.0 if not counts["reference"] else 0.0,
            "recall": matched / counts["reference"] if counts["reference"] else 1.0 if not counts["test"] else 0.0,
            "mean_iou": counts["iou_sum"] / matched if matched else (1.0 if not counts["reference"] and not counts["test"] else 0.0)}
