# cython: language_level=3
"""Free list of KV-cache pages.

Rules:
- A page id is either free (on the stack) or in use (owned by exactly one
  caller); ``allocate`` moves ids from free to in use, ``free`` back.
- ``allocate(n)`` is all-or-nothing: it returns n ids or raises, never part.
- Freeing a page that is not in use is an error (double free, foreign id).
- Allocation policy (who may take pages, eviction) belongs to the scheduler;
  this is only the ledger.
"""

import numpy as np
cimport numpy as cnp
from libc.stdint cimport int32_t, uint8_t

cnp.import_array()


class PagePoolExhausted(MemoryError):
    pass


cdef class PageAllocator:
    def __cinit__(self, int32_t num_pages):
        if num_pages <= 0:
            raise ValueError(f"num_pages must be positive, got {num_pages}")
        self.num_pages = num_pages
        # Highest id on top of the stack is popped last: pages come out 0, 1, 2...
        self.free_ids = np.arange(num_pages - 1, -1, -1, dtype=np.int32)
        self.num_free = num_pages
        self.in_use = np.zeros(num_pages, dtype=np.uint8)

    @property
    def num_used(self):
        return self.num_pages - self.num_free

    def can_allocate(self, int32_t n):
        return 0 <= n <= self.num_free

    def allocate(self, int32_t n):
        """Take ``n`` free page ids; returns an int32 array of them."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        if n > self.num_free:
            raise PagePoolExhausted(f"{n} pages requested, {self.num_free} free of {self.num_pages}")
        out = np.empty(n, dtype=np.int32)
        cdef int32_t[::1] o = out
        cdef int32_t i, page
        for i in range(n):
            self.num_free -= 1
            page = self.free_ids[self.num_free]
            self.in_use[page] = 1
            o[i] = page
        return out

    def free(self, page_ids):
        """Return pages to the pool. Raises (and frees nothing) on a bad id."""
        cdef int32_t[::1] ids = np.ascontiguousarray(page_ids, dtype=np.int32)
        cdef Py_ssize_t i, j, n = ids.shape[0]
        cdef int32_t page
        for i in range(n):
            page = ids[i]
            if page < 0 or page >= self.num_pages:
                raise ValueError(f"page id {page} is outside the pool of {self.num_pages}")
            if not self.in_use[page]:
                raise ValueError(f"page {page} is not in use (double free?)")
            for j in range(i):
                if ids[j] == page:
                    raise ValueError(f"page {page} appears twice in one free() call")
        for i in range(n):
            page = ids[i]
            self.in_use[page] = 0
            self.free_ids[self.num_free] = page
            self.num_free += 1

    def check_integrity(self):
        """free + used == total, and the free stack holds exactly the unused ids."""
        cdef int32_t i, used = 0
        seen = np.zeros(self.num_pages, dtype=np.uint8)
        for i in range(self.num_pages):
            used += self.in_use[i]
        if used + self.num_free != self.num_pages:
            raise AssertionError(f"used {used} + free {self.num_free} != {self.num_pages}")
        for i in range(self.num_free):
            page = self.free_ids[i]
            if self.in_use[page] or seen[page]:
                raise AssertionError(f"page {page} is on the free stack but in use or listed twice")
            seen[page] = 1
        return True
