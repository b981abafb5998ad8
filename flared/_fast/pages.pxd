from libc.stdint cimport int32_t, uint8_t

cdef class PageAllocator:
    # Number of pages in the pool; page ids are 0 .. num_pages-1.
    cdef readonly int32_t num_pages
    # Free page ids, used as a LIFO stack: free_ids[0:num_free] are free.
    # LIFO keeps recently freed (cache-warm) pages in use first.
    cdef int32_t[::1] free_ids
    cdef readonly int32_t num_free
    # 1 where the page is allocated, 0 where it is free; catches double free.
    cdef uint8_t[::1] in_use
