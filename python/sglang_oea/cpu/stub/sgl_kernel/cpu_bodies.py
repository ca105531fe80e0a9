"""Plain-torch bodies for the few CPU ops of `sgl_kernel` that SGLang's CPU engine calls.

Only speculative decoding calls them (KV-slot moves, draft-token bookkeeping, greedy tree
verification); these are the ones an NGRAM server calls. Each body states the op's contract as
SGLang's call sites and their Triton counterparts use it; they are written for tiny CPU test
models, not for speed.

Shape legend: B = requests, D = draft tokens per request, A = accepted-token slots per request.
"""

import ctypes

import torch


def copy_all_layer_kv_cache_cpu(data_ptrs, strides, tgt_loc, src_loc) -> None:
    """Copy KV slot rows src_loc[i] -> tgt_loc[i] in every buffer, in place.

    Args:
        data_ptrs: [L] uint64, the address of each contiguous KV buffer (per layer, K and V).
        strides: [L] int, bytes per slot row of each buffer (also the bytes copied per row).
        tgt_loc, src_loc: [M] int, slot indices.
    All sources are read before any target is written, so overlapping moves are safe.
    """
    if tgt_loc.numel() == 0:
        return
    tgt, src = tgt_loc.long(), src_loc.long()
    rows = int(torch.maximum(tgt.max(), src.max())) + 1  # the buffers hold at least this many slots
    for address, row_bytes in zip(data_ptrs.tolist(), strides.tolist()):
        memory = (ctypes.c_uint8 * (rows * row_bytes)).from_address(address)
        slots = torch.frombuffer(memory, dtype=torch.uint8).view(rows, row_bytes)
        slots[tgt] = slots[src]


def _request_spans(start_offset, end_offset):
    """Yield (request, start, end, packed offset): request i's token range [start, end) and where
    its slots sit in a buffer that packs every request's range back to back."""
    packed = 0
    for i, (start, end) in enumerate(zip(start_offset.tolist(), end_offset.tolist())):
        yield i, start, end, packed
        packed += end - start


def assign_req_to_token_pool_cpu(req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc,
                                 pool_len: int) -> None:
    """req_to_token[req_pool_indices[i], start_i:end_i] = request i's packed slots of out_cache_loc.

    Args:
        req_pool_indices, start_offset, end_offset: [B] int.
        req_to_token: [R, pool_len] int32, written in place.
        out_cache_loc: [sum(end - start)] int, the new slots, request after request.
    """
    for i, start, end, packed in _request_spans(start_offset, end_offset):
        row = int(req_pool_indices[i])
        req_to_token[row, start:end] = out_cache_loc[packed:packed + end - start].to(req_to_token.dtype)


def assign_extend_cache_locs_cpu(req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc,
                                 pool_len: int) -> None:
    """The reverse: out_cache_loc packs req_to_token[req_pool_indices[i], start_i:end_i], request
    after request (out_cache_loc is written in place)."""
    for i, start, end, packed in _request_spans(start_offset, end_offset):
        row = int(req_pool_indices[i])
        out_cache_loc[packed:packed + end - start] = req_to_token[row, start:end].to(out_cache_loc.dtype)


def reconstruct_indices_from_tree_mask(tree_mask, verified_seq_len, positions, retrieve_index,
                                       retrieve_next_token, retrieve_next_sibling, batch_size: int,
                                       draft_token_num: int) -> None:
    """Verify metadata of a draft-token tree, from its ancestor mask (all outputs in place).

    Args:
        tree_mask: [B * D * D] bool; tree_mask[b, i, j] marks node j as an ancestor of node i
            (entries with j >= i are ignored).
        verified_seq_len: [B] int, tokens already verified per request.
        positions: [B * D] int: the number of ancestors of each node plus verified_seq_len[b].
        retrieve_index: [B, D] int: b * D + node.
        retrieve_next_token: [B, D] int: the first later node the node is an ancestor of, else -1.
        retrieve_next_sibling: [B, D] int: the first later node with the same parent, else -1
            (-1 for a node without a parent). A node's parent is its highest-index ancestor.
    """
    b, d = batch_size, draft_token_num
    node = torch.arange(d)
    ancestors = tree_mask.view(b, d, d).bool() & (node[None, :] < node[:, None])  # [B, i, j]: j ancestor of i
    positions.view(b, d).copy_(ancestors.sum(dim=2) + verified_seq_len.view(b, 1).to(positions.dtype))
    retrieve_index.view(b, d).copy_(torch.arange(b * d).view(b, d))
    none = torch.full((b, d), -1, dtype=torch.long)
    parent = torch.where(ancestors.any(dim=2), (ancestors * node).amax(dim=2), none)  # [B, D]
    # first later node k (k > j) that j is an ancestor of: the smallest k with ancestors[b, k, j]
    after = torch.where(ancestors.transpose(1, 2), node, d).amin(dim=2)  # [B, j]
    retrieve_next_token.view(b, d).copy_(torch.where(after < d, after, none))
    later = node[None, :] > node[:, None]  # [i, k]: k after i
    same_parent = (parent[:, :, None] == parent[:, None, :]) & later & (parent[:, :, None] >= 0)  # [B, i, k]
    sibling = torch.where(same_parent, node, d).amin(dim=2)
    retrieve_next_sibling.view(b, d).copy_(torch.where(sibling < d, sibling, none))


def verify_tree_greedy_cpu(predicts, accept_index, accept_token_num, candidates, retrive_index,
                           retrive_next_token, retrive_next_sibling, target_predict) -> None:
    """Greedy verification of each request's draft tree against the target's argmax tokens.

    Walks from the root: at each level, the first child (then its siblings) whose draft token equals
    the target's token at the last accepted node is accepted. Outputs are written in place.

    Args:
        predicts: [B * D] int: at each accepted node, the target token that follows it.
        accept_index: [B, A] int: flat node indices of the accepted path (root first).
        accept_token_num: [B] int: accepted draft tokens (the root is not counted).
        candidates: [B, D] int draft tokens; retrive_*: [B, D] int tree links (-1 = none).
        target_predict: [B, D] int, the target's argmax at each node.
    """
    flat_target = target_predict.reshape(-1)
    for b in range(candidates.shape[0]):
        last = int(retrive_index[b, 0])
        accept_index[b, 0] = last
        accepted, node = 0, 0
        for _ in range(1, accept_index.shape[1]):
            node = int(retrive_next_token[b, node])
            target = flat_target[last]
            while node != -1 and candidates[b, node] != target:
                node = int(retrive_next_sibling[b, node])
            if node == -1:
                break
            predicts[last] = target
            accepted += 1
            last = int(retrive_index[b, node])
            accept_index[b, accepted] = last
        accept_token_num[b] = accepted
        predicts[last] = flat_target[last]


def fill_accept_out_cache_loc_cpu(accept_index, out_cache_loc, accept_out_cache_loc) -> None:
    """accept_out_cache_loc[:n] = out_cache_loc at the n accepted indices (accept_index != -1),
    in order; the rest is left alone."""
    picked = accept_index.reshape(-1)
    picked = picked[picked != -1].long()
    accept_out_cache_loc[:picked.numel()] = out_cache_loc[picked].to(accept_out_cache_loc.dtype)

