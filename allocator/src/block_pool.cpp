// block_pool.cpp — the pool index's cold paths: streams, walking backwards,
// membership and the self-check that validate() runs.
#include "block_pool.hpp"

#include <algorithm>

namespace mem::detail {

BlockPool::BlockPool(bool small) : is_small(small) {}

StreamClasses* BlockPool::find_slow(StreamId stream) const noexcept {
  const auto it = std::lower_bound(streams_.begin(), streams_.end(), stream,
                                   [](const auto& sc, StreamId s) { return sc->stream() < s; });
  if (it == streams_.end() || (*it)->stream() != stream) return nullptr;
  cached_stream_ = stream;
  cached_ = it->get();
  return cached_;
}

StreamClasses& BlockPool::add(StreamId stream) {
  // Streams come and go (a program may create thousands): a new one first
  // drops the tables of streams that hold no free block, so memory and
  // validate() follow the streams in use, not every stream ever seen.
  std::erase_if(streams_, [](const auto& sc) { return sc->count == 0; });
  const auto it = std::lower_bound(streams_.begin(), streams_.end(), stream,
                                   [](const auto& sc, StreamId s) { return sc->stream() < s; });
  // The constructor leaves the trees uninitialized: no 20 KB of stores.
  StreamClasses* sc = streams_.emplace(it, std::make_unique<StreamClasses>(stream))->get();
  cached_stream_ = stream;
  cached_ = sc;
  return *sc;
}

Block* BlockPool::largest(StreamId stream) const noexcept {
  const StreamClasses* sc = find(stream);
  if (sc == nullptr) return nullptr;
  const std::size_t c = sc->prev_nonempty(kNumSizeClasses - 1);
  return c == StreamClasses::kNone ? nullptr : sc->tree(c).last();
}

std::size_t BlockPool::largest_size() const noexcept {
  std::size_t out = 0;
  for (const auto& sc : streams_) {
    const std::size_t c = sc->prev_nonempty(kNumSizeClasses - 1);
    if (c != StreamClasses::kNone) out = std::max(out, sc->tree(c).last()->size);
  }
  return out;
}

Block* BlockPool::before(const Block* b) const noexcept {
  const StreamClasses* sc = find(b->stream);
  if (Block* p = sc->tree(b->pool_class).prev(b)) return p;
  const std::size_t c =
      b->pool_class == 0 ? StreamClasses::kNone : sc->prev_nonempty(b->pool_class - 1u);
  return c == StreamClasses::kNone ? nullptr : sc->tree(c).last();
}

Block* BlockPool::after(const Block* b) const noexcept {
  const StreamClasses* sc = find(b->stream);
  if (Block* n = sc->tree(b->pool_class).next(b)) return n;
  const std::size_t c = sc->next_nonempty(b->pool_class + 1u);
  return c == StreamClasses::kNone ? nullptr : sc->tree(c).first();
}

bool BlockPool::contains(const Block* b) const {
  const StreamClasses* sc = find(b->stream);
  if (sc == nullptr) return false;
  const std::size_t c = class_of(b->size);
  return sc->has(c) && sc->tree(c).find(b->size, b->ptr) == b;
}

std::string BlockPool::check() const {
  std::size_t count = 0;
  for (std::size_t i = 0; i < streams_.size(); ++i) {
    const StreamClasses& sc = *streams_[i];
    if (i > 0 && streams_[i - 1]->stream() >= sc.stream()) return "pool streams out of order";
    std::size_t stream_count = 0;
    for (std::size_t w = 0; w < StreamClasses::kWords; ++w) {
      if (sc.summary_bit(w) != (sc.word(w) != 0)) {
        return "a size-class summary bit disagrees with its word";
      }
    }
    // Only marked classes have trees; walk those (validate() runs this often).
    for (std::size_t c = sc.next_nonempty(0); c != StreamClasses::kNone;
         c = sc.next_nonempty(c + 1)) {
      const BlockTree& tree = sc.tree(c);
      if (tree.empty()) return "a size class is marked but holds no block";
      std::size_t in_tree = 0;
      if (const char* error = tree.check(in_tree)) return error;
      std::size_t walked = 0;
      for (const Block* b = tree.first(); b != nullptr; b = tree.next(b)) {
        if (class_of(b->size) != c || b->pool_class != c) {
          return "a block sits in the wrong size class";
        }
        if (b->stream != sc.stream()) return "a block sits under the wrong stream";
        if (b->pool != this) return "a block sits in the wrong pool";
        ++walked;
      }
      if (walked != in_tree) return "a size class's walk misses blocks";
      stream_count += walked;
    }
    if (sc.count != stream_count) return "a stream's block count disagrees with its trees";
    count += stream_count;
    if (sc.lowest() != std::min(sc.next_nonempty(0), kNumSizeClasses)) {
      return "a pool's lowest size class is stale";
    }
  }
  if (count != size_) return "the pool's block count disagrees with its trees";
  return {};
}

}  // namespace mem::detail
