"""model.loss=chunked: the LM head and its cross-entropy a chunk of tokens at a time, so the
(tokens, vocab) logits never exist whole; the same loss and gradients as the full path (tested).
GPT imports this when its config asks for it:

    loss = chunked_cross_entropy(x, lm_head.weight, targets, cap, ignore_index, vocab_size)

The head is multiplied whole, padded rows too (model.vocab_pad_multiple: 50257 -> 50304 rows,
the shape matmul kernels run fastest), and the padded logits are set to -inf before the
softmax, so they take no probability and their rows no gradient.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

LOSS_CHUNK_LOGITS = 2**25  # logits per chunk of model.loss=chunked: 128 MiB in float32


def loss_chunk_rows(tokens: int, vocab: int) -> int:
    """Tokens per chunk of the chunked loss (667 at GPT-2's vocabulary). Far fewer rows (torch's
    default: 32 for 4,096 tokens) leave CPU matmuls re-reading the whole head for little work."""
    return max(1, min(tokens, LOSS_CHUNK_LOGITS // vocab))


def _chunk_loss(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                row_weight: torch.Tensor, grad_x: torch.Tensor | None,
                grad_w: torch.Tensor | None, cap: float = 0.0,
                vocab_size: int = 0) -> torch.Tensor:
    """One chunk of ChunkedCrossEntropy -> its share of the mean loss; its gradients go into
    grad_x (the chunk's rows) and add to grad_w. Its (rows, V) buffers die on return."""
    logits = (x @ weight.T).float()  # (rows, V): the only logits that exist
    squashed = None
    if cap:  # model.logit_softcap: cap * tanh(logits / cap)
        squashed = logits.div_(cap).tanh_()
        logits = squashed * cap
    if vocab_size and vocab_size < logits.size(1):  # padded rows: no probability, no gradient
        logits[:, vocab_size:] = float("-inf")
    picked = targets.clamp(min=0)[:, None]  # ignored rows: any class, their row_weight is 0
    target_logit = logits.gather(1, picked).squeeze(1)
    peak = logits.amax(dim=-1, keepdim=True)  # logsumexp in place: no second (rows, V) buffer
    exp = logits.sub_(peak).exp_()
    total = exp.sum(dim=-1, keepdim=True)
    loss = ((peak + total.log()).squeeze(1) - target_logit).mul_(row_weight).sum()
    if grad_x is None and grad_w is None:
        return loss
    # d(mean loss)/d(logits) = (softmax - one_hot(target)) * row_weight
    grad = exp.div_(total).scatter_add_(1, picked, -torch.ones_like(logits[:, :1]))
    grad = grad.mul_(row_weight[:, None])
    if squashed is not None:  # d(cap * tanh(z / cap))/dz = 1 - tanh(z / cap)^2
        grad = grad.mul_(squashed.square_().neg_().add_(1))
    grad = grad.to(x.dtype)
    if grad_x is not None:
        grad_x.copy_(grad @ weight)
    if grad_w is not None and grad.dtype == torch.float32:
        grad_w.addmm_(grad.T, x)
    elif grad_w is not None:  # bf16 products, summed over chunks in float32
        grad_w += grad.T @ x
    return loss


class ChunkedCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of x @ weight.T, one chunk of tokens at a time: each chunk's logits
    give its loss and, at once, its gradients (kept for backward, which only scales them).
    Where torch's F.linear_cross_entropy is missing or rounds the loss (see chunked_loss_impl)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                cap: float = 0.0, ignore_index: int = -1, vocab_size: int = 0) -> torch.Tensor:
        # x (N, C), weight (V, C), targets (N,) with ignore_index where nothing is predicted;
        # vocab_size < V: the rows past it are padding
        valid = targets != ignore_index
        row_weight = valid / valid.sum()  # (N,): 1/count, 0 where ignored
        grad_x = torch.empty_like(x) if ctx.needs_input_grad[0] else None
        grad_w = torch.zeros_like(weight, dtype=torch.float32) if ctx.needs_input_grad[1] else None
        rows = loss_chunk_rows(x.size(0), weight.size(0))
        loss = torch.zeros((), device=x.device)
        for start in range(0, x.size(0), rows):
            chunk = slice(start, start + rows)
            loss += _chunk_loss(x[chunk], weight, targets[chunk], row_weight[chunk],
                                None if grad_x is None else grad_x[chunk], grad_w, cap,
                                vocab_size)
        ctx.grads, ctx.weight_dtype = (grad_x, grad_w), weight.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        grad_x, grad_w = ctx.grads
        del ctx.grads  # the gradients are scaled in place: backward runs once
        if grad_x is not None:
            grad_x.mul_(grad_loss)
        if grad_w is not None:
            grad_w = grad_w.mul_(grad_loss).to(ctx.weight_dtype)
        return grad_x, grad_w, None, None, None, None


def chunked_loss_impl(dtype: torch.dtype, cap: float = 0.0, padded: bool = False) -> str:
    """Which chunked loss runs for matmuls in this dtype: 'torch' (F.linear_cross_entropy, torch
    >= 2.13) or 'ours' (ChunkedCrossEntropy; also for bf16, whose loss torch's rounds to bf16,
    with a logit soft-cap, which torch's does not apply, and with a padded head, whose padded
    logits torch's cannot leave out)."""
    native = hasattr(F, "linear_cross_entropy") and hasattr(nn, "LinearCrossEntropyOptions")
    native = native and dtype != torch.bfloat16 and not cap and not padded
    return "torch" if native else "ours"


def chunked_cross_entropy(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                          cap: float = 0.0, ignore_index: int = -1,
                          vocab_size: int = 0) -> torch.Tensor:
    """Mean cross-entropy of the logits x @ weight.T (x (..., C), weight (V, C)) against targets
    (...,), ignore_index skipped, computed by chunks of tokens: the logits never exist whole.
    cap > 0: the logits soft-capped first (model.logit_softcap). 0 < vocab_size < V: weight's
    rows past vocab_size are padding, multiplied with the rest but left out of the softmax.
    The matmuls run in autocast's dtype, as the full path's LM head would; the loss is float32."""
    device = x.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else weight.dtype
    x, weight, targets = x.reshape(-1, x.size(-1)).to(dtype), weight.to(dtype), targets.reshape(-1)
    vocab_size = vocab_size if 0 < vocab_size < weight.size(0) else 0  # 0: every row counts
    if chunked_loss_impl(dtype, cap, padded=bool(vocab_size)) == "torch":
        rows = loss_chunk_rows(x.size(0), weight.size(0))
        return F.linear_cross_entropy(x, weight, targets, ignore_index=ignore_index,
                                      options=nn.LinearCrossEntropyOptions(batch_chunk_size=rows))
    return _chunked_eager(x, weight, targets, cap, ignore_index, vocab_size)


_chunks_outside_compile = None  # torch.compiler.disable(ChunkedCrossEntropy.apply), on first use


def _chunked_eager(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                   cap: float, ignore_index: int, vocab_size: int) -> torch.Tensor:
    """ChunkedCrossEntropy.apply, kept out of compiled graphs (the chunk loop is large matmuls:
    nothing to gain). The wrapper is made on first use: making it imports torch._dynamo, a
    second or so that a run evaluating a checkpoint without training need not pay."""
    global _chunks_outside_compile
    if _chunks_outside_compile is None:
        _chunks_outside_compile = torch.compiler.disable(ChunkedCrossEntropy.apply)
    return _chunks_outside_compile(x, weight, targets, cap, ignore_index, vocab_size)

