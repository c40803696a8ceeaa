// One layer's keys (or values) of the block-major KV pool, as the kernels read and write it:
// a [blocks, block_size, kv_heads, dim] view whose rows are contiguous within a block and whose
// blocks lie `block_stride` elements apart (every layer's keys and values of a block sit
// together, so that a run of blocks crosses the data plane as one piece; see kv_cache.py).
#pragma once
#include <torch/extension.h>

#include <cstdint>

struct PoolLayer {
  int64_t blocks, block_stride, row;  // row: one position's elements (kv_heads * dim)

  // The element offset of position `offset` within block `block`.
  int64_t at(int64_t block, int64_t offset) const { return block * block_stride + offset * row; }
  // The element offset of slot `slot` (block * block_size + offset).
  int64_t at_slot(int64_t slot, int64_t block_size) const { return at(slot / block_size, slot % block_size); }
};

// The geometry of keys and values, checked: same shape and strides, contiguous within a block.
inline PoolLayer pool_layer(const torch::Tensor& keys, const torch::Tensor& values, int64_t block_size,
                            const char* who) {
  TORCH_CHECK(keys.dim() == 4 && values.sizes() == keys.sizes() && values.strides() == keys.strides() &&
                  keys.size(1) == block_size && block_size > 0 && keys.size(2) > 0 && keys.stride(3) == 1 &&
                  keys.stride(2) == keys.size(3) && keys.stride(1) == keys.size(2) * keys.size(3) &&
                  keys.stride(0) >= block_size * keys.stride(1) && values.scalar_type() == keys.scalar_type(),
              who, ": keys and values [blocks, block_size, kv_heads, dim], contiguous within a block");
  return PoolLayer{keys.size(0), keys.stride(0), keys.size(2) * keys.size(3)};
}
