"""Plain-torch bodies for the `sgl_kernel` CPU ops that SGLang's CPU engine calls under EAGLE / MTP.

An EAGLE draft proposes a token tree (a chain when --speculative-eagle-topk is 1); these ops lay
out its KV slots, turn the draft model's choices into the tree the target verifies, and pick each
request's bonus token after verification. Each body states the op's contract as SGLang's call
sites and their Triton counterparts use it; they are written for tiny CPU test models, not speed.

Shape legend: B = requests, K = draft top-k (branches), S = draft steps, D = draft tokens per
request (the tree's nodes, root included), A = accepted-token slots per request (S + 1).
"""

import torch

FULL_MASK, QLEN_ONLY = 0, 1  # sglang's TreeMaskMode values this body writes


def assign_draft_cache_locs_contiguous_cpu(req_pool_indices, req_to_token, seq_lens, out_cache_loc, pool_len: int,
                                           topk: int, num_cols: int) -> None:
    """out_cache_loc[b * K * C : (b + 1) * K * C] = req_to_token[req_pool_indices[b], seq_lens[b]:][:K * C].

    The scheduler has already allocated each request's draft slots right after its committed
    tokens; this gathers them request after request (C = num_cols steps per branch).

    Args:
        req_pool_indices, seq_lens: [B] int.
        req_to_token: [R, pool_len] int32.
        out_cache_loc: [B * K * C] int64, written in place.
    """
    width = topk * num_cols
    for b, (row, start) in enumerate(zip(req_pool_indices.tolist(), seq_lens.tolist())):
        out_cache_loc[b * width:(b + 1) * width] = req_to_token[row, start:start + width].to(out_cache_loc.dtype)


def fill_bonus_tokens_cpu(accept_tokens, accept_lens, bonus_tokens, accept_stride: int) -> None:
    """bonus_tokens[b] = the last accepted token of request b (accept_lens counts the bonus token).

    Args:
        accept_tokens: [B, A] int (read flat with row stride accept_stride).
        accept_lens: [B] int, >= 1.
        bonus_tokens: [B] int32, written in place.
    """
    last = torch.arange(accept_lens.numel()) * accept_stride + accept_lens.long() - 1
    bonus_tokens.copy_(accept_tokens.reshape(-1)[last].to(bonus_tokens.dtype))


def _tree_parents(selected, parents, topk: int):
    """Each node's parent node, from the draft's choices (one request).

    Node 0 is the root (the last verified token); node i >= 1 is the draft token selected[i - 1],
    an index into the draft's flat list of scored candidates, in which candidate c was expanded
    from bucket c // K. Bucket 0 holds the root's children; bucket t > 0 holds the children of
    candidate parents[t]. Returns a list over nodes: the parent node, or None for the root and for
    a node whose parent candidate is not among the selected (an orphan: neither linked nor masked).
    """
    node_of = {}
    for position, candidate in enumerate(selected):
        node_of.setdefault(candidate, position + 1)  # the first selected position wins
    out = [None]
    for candidate in selected:
        bucket = candidate // topk
        out.append(0 if bucket == 0 else node_of.get(parents[bucket]))
    return out


def build_tree_kernel_efficient_cpu(parent_list, top_scores_index, seq_lens, tree_mask, positions, retrieve_index,
                                    retrieve_next_token, retrieve_next_sibling, topk: int, spec_steps: int,
                                    num_verify_tokens: int, tree_mask_mode: int) -> None:
    """The verify tree of each request's draft: ancestor mask, positions and walk links (in place).

    Args:
        parent_list: [B, P] int, the candidate each bucket expands (see _tree_parents).
        top_scores_index: [B, D - 1] int, the selected candidates in node order.
        seq_lens: [B] int, verified tokens per request.
        tree_mask: bool, pre-filled with True by the caller. QLEN_ONLY: [B * D * D], row i of request
            b marks the nodes node i attends to (itself and its ancestors, the root always);
            FULL_MASK: per request D rows of seq_lens[b] + D columns (prefix columns left alone).
        positions: [B * D] int: seq_lens[b] + the node's depth (the root has depth 0).
        retrieve_index: [B, D] int: b * D + node.
        retrieve_next_token: [B, D] int, pre-filled with -1: the node's first child.
        retrieve_next_sibling: [B, D] int, pre-filled with -1: the next child of the same parent.
        spec_steps: the tree's depth bound (the mask walk follows at most this many ancestors).
    """
    if tree_mask_mode not in (FULL_MASK, QLEN_ONLY):
        raise NotImplementedError(f"tree mask mode {tree_mask_mode} has no CPU body")
    d = num_verify_tokens
    mask_offset = 0
    for b, seq_len in enumerate(seq_lens.tolist()):
        parent = _tree_parents(top_scores_index[b].tolist(), parent_list[b].tolist(), topk)
        retrieve_index[b] = torch.arange(b * d, (b + 1) * d)
        for i in range(d - 1, 0, -1):  # children are chained in increasing order
            p = parent[i]
            if p is not None:
                retrieve_next_sibling[b, i] = retrieve_next_token[b, p]
                retrieve_next_token[b, p] = i
        prefix = seq_len if tree_mask_mode == FULL_MASK else 0
        rows = tree_mask[mask_offset:mask_offset + d * (prefix + d)].view(d, prefix + d)
        mask_offset += d * (prefix + d)
        rows[:, prefix:] = False
        rows[:, prefix] = True
        for i in range(d):
            node, depth = i, 0
            while node not in (0, None) and depth < spec_steps:
                rows[i, prefix + node] = True
                depth += 1
                node = parent[node]
            positions[b * d + i] = seq_len + depth
