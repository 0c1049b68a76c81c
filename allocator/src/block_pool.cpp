// block_pool.cpp — the pool index's cold paths: streams, walking backwards,
// membership and the self-check that validate() runs.
#include "block_pool.hpp"

#include <algorithm>


namespace mem::detail {

StreamClasses* StreamClasses::create(StreamId stream, FreeListArena* arena) {
  void* storage = ::operator new(sizeof(StreamClasses) + kNumSizeClasses * sizeof(BlockSet));
  return new (storage) StreamClasses(stream, arena);
}

void StreamClasses::build(std::size_t c) {
  new (sets() + c) BlockSet(PoolEntryLess{}, ArenaAllocator<PoolEntry>(arena_));
  built_[c >> 6] |= std::uint64_t{1} << (c & 63);
}

void StreamClasses::destroy(StreamClasses* sc) noexcept {
  for (std::size_t w = 0; w < kWords; ++w) {  // the built sets only, not every class
    for (std::uint64_t bits = sc->built_word(w); bits != 0; bits &= bits - 1) {
      sc->set((w << 6) + static_cast<std::size_t>(__builtin_ctzll(bits))).~BlockSet();
    }
  }
  sc->~StreamClasses();
  ::operator delete(sc);
}

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
  StreamClasses* sc = StreamClasses::create(stream, &arena_);
  streams_.emplace(it, sc);
  cached_stream_ = stream;
  cached_ = sc;
  return *sc;
}

void BlockPool::rekey_slow(Block* b, std::uintptr_t ptr, std::size_t size) {
  StreamClasses& sc = *find(b->stream);
  const std::size_t from = b->pool_class;
  const std::size_t to = class_of(size);
  BlockSet& set = sc.set(from);
  if (from != to && set.size() == 1 && sc.set_for_insert(to).empty()) {
    // Alone in its class and moving to an empty one (a segment's one free block
    // after a split or merge): hand over the whole tree, O(1).
    set.swap(sc.set(to));
    update_in_place(b, ptr, size);
    b->pool_class = static_cast<std::uint16_t>(to);
    sc.mark(to);  // first, so a shrinking block's class becomes the lowest without a search
    sc.unmark(from);
    return;
  }
  // Re-insert the same node under its new key (no allocation).
  BlockSet& dest = sc.set_for_insert(to);
  b->ptr = ptr;
  b->size = size;
  b->pool_class = static_cast<std::uint16_t>(to);
  auto node = set.extract(b->pool_it);
  if (from != to && set.empty()) sc.unmark(from);
  node.value() = PoolEntry{size, ptr, b};
  b->pool_it = dest.insert(std::move(node)).position;
  sc.mark(to);
}

Block* BlockPool::largest(StreamId stream) const noexcept {
  const StreamClasses* sc = find(stream);
  if (sc == nullptr) return nullptr;
  const std::size_t c = sc->prev_nonempty(kNumSizeClasses - 1);
  return c == StreamClasses::kNone ? nullptr : std::prev(sc->set(c).end())->block;
}

Block* BlockPool::before(const Block* b) const noexcept {
  const StreamClasses* sc = find(b->stream);
  std::size_t c = b->pool_class;
  if (b->pool_it != sc->set(c).begin()) return std::prev(b->pool_it)->block;
  c = c == 0 ? StreamClasses::kNone : sc->prev_nonempty(c - 1);
  return c == StreamClasses::kNone ? nullptr : std::prev(sc->set(c).end())->block;
}

bool BlockPool::contains(const Block* b) const {
  const StreamClasses* sc = find(b->stream);
  if (sc == nullptr) return false;
  const std::size_t c = class_of(b->size);
  if (!sc->has(c)) return false;
  const BlockSet& set = sc->set(c);
  const auto it = set.find(PoolEntry{b->size, b->ptr, nullptr});
  return it != set.end() && it->block == b;
}

std::string BlockPool::check() const {
  std::size_t count = 0;
  for (std::size_t i = 0; i < streams_.size(); ++i) {
    const StreamClasses& sc = *streams_[i];
    if (i > 0 && streams_[i - 1]->stream() >= sc.stream()) return "pool streams out of order";
    std::size_t stream_count = 0;
    // Only built classes can hold blocks; walk those (validate() runs this often).
    for (std::size_t w = 0; w < StreamClasses::kWords; ++w) {
      if (sc.summary_bit(w) != (sc.word(w) != 0)) {
        return "a size-class summary bit disagrees with its word";
      }
      if ((sc.word(w) & ~sc.built_word(w)) != 0) return "a size class is marked but has no set";
      for (std::uint64_t bits = sc.built_word(w); bits != 0; bits &= bits - 1) {
        const std::size_t c = (w << 6) + static_cast<std::size_t>(__builtin_ctzll(bits));
        const BlockSet& set = sc.set(c);
        if (sc.has(c) == set.empty()) return "a size-class bit disagrees with its set";
        for (auto it = set.begin(); it != set.end(); ++it) {
          const Block* b = it->block;
          if (it->size != b->size || it->ptr != b->ptr || b->stream != sc.stream()) {
            return "a pool entry's key disagrees with its block";
          }
          if (class_of(b->size) != c || b->pool_class != c) {
            return "a block sits in the wrong size class";
          }
          if (b->pool_it != it) return "a pooled block's node handle is stale";
          if (b->pool != this) return "a block sits in the wrong pool";
          ++stream_count;
        }
      }
    }
    if (sc.count != stream_count) return "a stream's block count disagrees with its sets";
    count += stream_count;
    if (sc.lowest() != std::min(sc.next_nonempty(0), kNumSizeClasses)) {
      return "a pool's lowest size class is stale";
    }
  }
  if (count != size_) return "the pool's block count disagrees with its sets";
  return {};
}

}  // namespace mem::detail
