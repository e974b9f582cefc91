// A node recycler for the pool's std::set and hash map.
//
// The pool's index containers allocate one node per insert. Recycling nodes through
// free lists kept by the pool (no locking: the pool's mutex already serializes every
// call that touches its containers) keeps malloc out of the hot path. Requests for more
// than one object (hash bucket arrays) go to operator new as usual.
#ifndef TFMG_NODE_ALLOCATOR_H_
#define TFMG_NODE_ALLOCATOR_H_

#include <cassert>
#include <cstddef>
#include <new>

namespace tfmg {

// Free lists for a few node sizes; owned by one pool, outlives its containers.
class node_arena {
 public:
  node_arena() = default;
  node_arena(const node_arena&) = delete;
  node_arena& operator=(const node_arena&) = delete;
  ~node_arena() {
    for (list& l : lists_) {
      while (l.head != nullptr) {
        link* next = l.head->next;
        ::operator delete(l.head);
        l.head = next;
      }
    }
  }

  void* get(std::size_t size) {
    list* l = find(size);
    if (l == nullptr || l->head == nullptr) return ::operator new(round(size));
    link* n = l->head;
    l->head = n->next;
    return n;
  }

  void put(void* p, std::size_t size) noexcept {
    list* l = find(size);
    if (l == nullptr) {
      ::operator delete(p);
      return;
    }
    link* n = static_cast<link*>(p);
    n->next = l->head;
    l->head = n;
  }

 private:
  struct link { link* next; };
  struct list {
    std::size_t size = 0;
    link* head = nullptr;
  };
  static std::size_t round(std::size_t size) { return size < sizeof(link) ? sizeof(link) : size; }
  list* find(std::size_t size) noexcept {
    size = round(size);
    for (list& l : lists_) {
      if (l.size == size) return &l;
      if (l.size == 0) {
        l.size = size;
        return &l;
      }
    }
    return nullptr;  // more node sizes than slots: fall back to operator new/delete
  }
  list lists_[4];
};

template <class T>
class node_allocator {
 public:
  using value_type = T;
  explicit node_allocator(node_arena* arena) noexcept : arena_(arena) {}
  template <class U>
  node_allocator(const node_allocator<U>& other) noexcept : arena_(other.arena()) {}

  T* allocate(std::size_t n) {
    if (n == 1) return static_cast<T*>(arena_->get(sizeof(T)));
    return static_cast<T*>(::operator new(n * sizeof(T)));
  }
  void deallocate(T* p, std::size_t n) noexcept {
    if (n == 1) {
      arena_->put(p, sizeof(T));
    } else {
      ::operator delete(p);
    }
  }
  node_arena* arena() const noexcept { return arena_; }
  template <class U>
  bool operator==(const node_allocator<U>& o) const noexcept { return arena_ == o.arena(); }
  template <class U>
  bool operator!=(const node_allocator<U>& o) const noexcept { return arena_ != o.arena(); }

 private:
  node_arena* arena_;
};

}  // namespace tfmg

#endif  // TFMG_NODE_ALLOCATOR_H_
