"""Plain numpy simulation of 1-bit Adam over N workers: the oracle for tests/test_onebit.py.

Written as plainly as possible, with explicit loops over workers and chunks and real byte
packing (`np.packbits`), in float64. It follows DeepSpeed's `OnebitAdam` and
`NcclBackend.compressed_allreduce`, with jaxspeed's documented choices: per-leaf compression,
padding to a multiple of 8 * N, Adam's bias correction (frozen with the variance), no
"initialization step".
"""

from __future__ import annotations

import math

import numpy as np


def padded_size(size: int, num_workers: int) -> int:
    unit = 8 * num_workers
    return max(1, math.ceil(size / unit)) * unit


def compress(y: np.ndarray) -> tuple[np.ndarray, float, np.ndarray]:
    """1-bit compression: (bits, scale, error) with C(y) = scale * sign(y), sign(0) = +1."""
    scale = np.linalg.norm(y) / np.sqrt(y.size)
    bits = y >= 0
    return bits, scale, y - scale * np.where(bits, 1.0, -1.0)


def decompress(packed: np.ndarray, scale: float) -> np.ndarray:
    return (np.unpackbits(packed).astype(np.float64) * 2.0 - 1.0) * scale


def compressed_allreduce(xs, worker_errors, server_errors):
    """One compressed all-reduce of one leaf over N = len(xs) workers.

    Args:
      xs: per worker, the flat values (unpadded).
      worker_errors: per worker, e_w of length padded_size(size, N).
      server_errors: per worker, e_s of length padded // N (the chunk that worker reduces).

    Returns:
      (mean, new worker errors, new server errors); `mean` flat, unpadded, the same on all
      workers.
    """
    n = len(xs)
    size = xs[0].size
    padded = padded_size(size, n)
    chunk = padded // n
    # Worker side: compress, cut into N chunks of packed bytes, one per server.
    messages = []  # messages[w] = (list of packed chunks, scale)
    new_worker_errors = []
    for w in range(n):
        y = np.zeros(padded)
        y[:size] = xs[w]
        y = y + worker_errors[w]
        bits, scale, error = compress(y)
        chunks = [np.packbits(bits[s * chunk:(s + 1) * chunk]) for s in range(n)]
        messages.append((chunks, scale))
        new_worker_errors.append(error)
    # Server side: server s averages chunk s of every worker, adds e_s, recompresses.
    replies = []
    new_server_errors = []
    for s in range(n):
        total = np.zeros(chunk)
        for w in range(n):
            chunks, scale = messages[w]
            total = total + decompress(chunks[s], scale) / n
        bits, scale, error = compress(total + server_errors[s])
        replies.append((np.packbits(bits), scale))
        new_server_errors.append(error)
    # Every worker gathers all servers' chunks.
    mean = np.concatenate([decompress(packed, scale) for packed, scale in replies])
    return mean[:size], new_worker_errors, new_server_errors


class OneBitAdamReference:
    """N-worker 1-bit Adam on a dict of float64 arrays (one optimizer replica per worker)."""

    def __init__(self, params, *, num_workers, learning_rate, b1=0.9, b2=0.999, eps=1e-8,
                 weight_decay=0.0, freeze_step=100000, bias_correction=True):
        self.n = num_workers
        self.lr = learning_rate
        self.b1, self.b2, self.eps, self.wd = b1, b2, eps, weight_decay
        self.freeze_step = freeze_step
        self.bias_correction = bias_correction
        self.count = 0
        self.m = {k: np.zeros(np.shape(p)) for k, p in params.items()}
        self.v = {k: np.zeros(np.shape(p)) for k, p in params.items()}
        padded = {k: padded_size(np.size(p), num_workers) for k, p in params.items()}
        self.error_worker = [{k: np.zeros(padded[k]) for k in params} for _ in range(self.n)]
        self.error_server = [
            {k: np.zeros(padded[k] // self.n) for k in params} for _ in range(self.n)
        ]

    def step(self, worker_grads, params):
        """One update. worker_grads: per worker, a dict like params. Returns the updates."""
        lr = self.lr(self.count) if callable(self.lr) else self.lr
        t = self.count + 1
        updates = {}
        for k, p in params.items():
            grads = [np.asarray(g[k], np.float64) for g in worker_grads]
            if self.count < self.freeze_step:
                g = sum(grads) / self.n
                self.m[k] = self.b1 * self.m[k] + (1 - self.b1) * g
                self.v[k] = self.b2 * self.v[k] + (1 - self.b2) * g * g
                v_steps = t
            else:
                local_m = [self.b1 * self.m[k] + (1 - self.b1) * g for g in grads]
                mean, new_ew, new_es = compressed_allreduce(
                    [m.reshape(-1) for m in local_m],
                    [e[k] for e in self.error_worker],
                    [e[k] for e in self.error_server],
                )
                for w in range(self.n):
                    self.error_worker[w][k] = new_ew[w]
                    self.error_server[w][k] = new_es[w]
                self.m[k] = mean.reshape(np.shape(p))
                v_steps = self.freeze_step
            m_hat, v_hat = self.m[k], self.v[k]
            if self.bias_correction:
                m_hat = m_hat / (1 - self.b1**t)
                if v_steps > 0:
                    v_hat = v_hat / (1 - self.b2**v_steps)
            u = m_hat / (np.sqrt(v_hat) + self.eps) + self.wd * np.asarray(p, np.float64)
            updates[k] = -lr * u
        self.count += 1
        return updates

    def flat_errors(self):
        """The error buffers in jaxspeed's flat layout: ([N, worker], [N, server]).

        Leaves in sorted-key order (jax's dict order). Worker w's row is its padded leaf errors
        cut into N chunks, row-major over (chunk j, leaf l); its server row is its leaf server
        chunks, leaf after leaf.
        """
        keys = sorted(self.m)
        worker_rows, server_rows = [], []
        for w in range(self.n):
            pieces = []
            for j in range(self.n):
                for k in keys:
                    chunk = self.error_worker[w][k].size // self.n
                    pieces.append(self.error_worker[w][k][j * chunk:(j + 1) * chunk])
            worker_rows.append(np.concatenate(pieces))
            server_rows.append(np.concatenate([self.error_server[w][k] for k in keys]))
        return np.stack(worker_rows), np.stack(server_rows)
