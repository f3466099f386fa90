"""Softmax cross-entropy with an ignore mask, and the multi-token-prediction (MTP) loss built on it.

Cross-entropy over rows of logits [N, V] with int targets [N]; a target of −1 carries no loss and no
gradient. The loss is the mean over the n valid rows: L = (1/n) Σ (logsumexp(z) − z[t]), so
dz = (softmax(z) − onehot(t)) / n on valid rows and 0 elsewhere. With no valid row the loss is 0.

MTP: head k (0-based) predicts the token k+1 ahead. For tokens [B, T+K], head k's targets are
tokens[:, 1+k : T+1+k]:

    mtp_targets([[5, 6, 7, 8]], T=2, K=2) -> [[[6, 7]], [[7, 8]]]        # [K, B, T]

The training objective is the mean of the K heads' mean cross-entropies; the reported loss is head 0's.
"""
import numpy as np


def cross_entropy_forward(logits, targets):
    """logits [N, V], targets int [N] (−1 = ignore) -> (mean loss over valid rows, cache)."""
    valid = targets >= 0
    n = int(valid.sum())
    z = logits - logits.max(axis=-1, keepdims=True)
    logsumexp = np.log(np.exp(z).sum(axis=-1))  # [N]
    picked = np.take_along_axis(z, np.where(valid, targets, 0)[:, None], axis=-1)[:, 0]
    losses = np.where(valid, logsumexp - picked, 0.0)
    loss = float(losses.sum() / n) if n else 0.0
    return loss, (z, logsumexp, targets, valid, n)


def cross_entropy_backward(dloss, cache):
    """dloss scalar -> dlogits [N, V]."""
    z, logsumexp, targets, valid, n = cache
    if n == 0:
        return np.zeros_like(z)
    dz = np.exp(z - logsumexp[:, None])  # softmax
    dz[np.arange(len(targets))[valid], targets[valid]] -= 1.0
    dz *= (valid * (dloss / n))[:, None].astype(z.dtype)
    return dz


def mtp_targets(tokens, T, K, loss_mask=None):
    """tokens int [B, T+K] (loss_mask bool [B, T+K] or None) -> targets int [K, B, T], −1 where masked."""
    targets = np.stack([tokens[:, 1 + k:T + 1 + k] for k in range(K)]).astype(np.int64)
    if loss_mask is not None:
        keep = np.stack([loss_mask[:, 1 + k:T + 1 + k] for k in range(K)])
        targets = np.where(keep, targets, -1)
    return targets


def mtp_loss_forward(logits, targets):
    """logits [K, B, T, V], targets [K, B, T] -> (objective, per-head losses [K], cache)."""
    K, V = logits.shape[0], logits.shape[-1]
    head_losses, caches = [], []
    for k in range(K):
        loss, cache = cross_entropy_forward(logits[k].reshape(-1, V), targets[k].reshape(-1))
        head_losses.append(loss)
        caches.append(cache)
    return sum(head_losses) / K, head_losses, (caches, logits.shape)


def mtp_loss_backward(dobjective, cache):
    """dobjective scalar -> dlogits [K, B, T, V]."""
    caches, shape = cache
    K = shape[0]
    return np.stack([cross_entropy_backward(dobjective / K, c).reshape(shape[1:]) for c in caches])
