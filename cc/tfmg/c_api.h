/* tf_memguard core: the plain C interface.
 *
 * Everything outside the core (the pybind11 module, the TensorFlow plugin, benchmarks)
 * talks to the pool through this header only, so that one copy of the core per process
 * (libtfmg_core.so) serves every user of it: the plugin dlopen()s the library and looks
 * these symbols up by name.
 *
 * Every function is thread-safe unless it says otherwise. Functions return a
 * tfmg_status; on anything but TFMG_OK, tfmg_last_error() returns a message for the
 * calling thread that says what happened, the state, and what to do.
 */
#ifndef TFMG_C_API_H_
#define TFMG_C_API_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define TFMG_API __attribute__((visibility("default")))

/* Bumped whenever a struct below or a function signature changes; the plugin and the
 * bindings refuse a core whose version differs from the header they were built with. */
#define TFMG_ABI_VERSION 5  /* 5: zones (tfmg_pool_options and tfmg_pool_layout gain zone_threshold) */

typedef enum tfmg_status {
  TFMG_OK = 0,
  TFMG_ERROR_INVALID_ARGUMENT = 1, /* a caller's mistake: bad size, alignment, option */
  TFMG_ERROR_OUT_OF_MEMORY = 2,    /* the budget (or the upstream) cannot serve it */
  TFMG_ERROR_UNKNOWN_POINTER = 3,  /* free of a pointer this pool never handed out */
  TFMG_ERROR_DOUBLE_FREE = 4,      /* free of a block that is already free */
  TFMG_ERROR_UPSTREAM = 5,         /* the upstream failed for a reason other than size */
  TFMG_ERROR_INVALID_STATE = 6     /* call in the wrong order (e.g. destroy while in use) */
} tfmg_status;

/* Allocation flags. */
#define TFMG_ALLOC_DEFAULT 0u
/* The caller cannot handle a refusal (TensorFlow crashes on a null for a numpy input,
 * say). If the budget cannot serve the request, it is taken straight from the upstream
 * and accounted as overshoot. Fails only when the upstream itself fails. Overshoot
 * counts against the budget: while it is in use, the requests that can be refused get
 * that much less room, so the account (pooled bytes in use plus overshoot) passes the
 * budget only by what unrefusable requests were granted over it. */
#define TFMG_ALLOC_MUST_SUCCEED 1u
/* The block's size is proportional to the training batch (its first dimension is the
 * batch size), as classified by the caller while profiling (tfmg_set_profile_batch).
 * The pool keeps how many such bytes are live, and how many were at the window peak:
 * the split of a step's peak into a fixed part and a per-sample part. */
#define TFMG_ALLOC_BATCH 2u
/* A probe: a request the budget cannot serve fails without being recorded as a refusal
 * (no count, no last_refusal, no trace event). For a caller that decides what to do
 * about a request only once it knows the request does not fit. */
#define TFMG_ALLOC_QUIET 4u
/* A hint, kept in the trace only: the block's first dimension is a multiple (2 or more) of
 * the profiled batch size, as a batch-shaped tensor's is once its leading dimensions are
 * flattened (a Dense layer on (batch, steps, features) computes on (batch x steps,
 * features); an embedding's gradient has batch x steps rows). A weight's gradient can
 * have such a first dimension too: the memory model counts the block as proportional to
 * the batch only where a step at another batch size confirms it. */
#define TFMG_ALLOC_BATCH_ROWS 8u
/* A hint, kept in the trace only: the block's second dimension is the profiled batch size
 * or a multiple of it too, as well as its first (TFMG_ALLOC_BATCH or _ROWS): a tensor of
 * batch x batch entries, which grows with the square of the batch (the similarities of
 * every pair of samples in a batch, as contrastive losses compute them). A dimension can
 * equal the batch size by chance (64 features at a batch of 64): the memory model takes
 * the block as quadratic only where a step at another batch size confirms it. */
#define TFMG_ALLOC_BATCH_SQUARE 32u
/* A request the budget cannot serve now waits for blocks other threads free, and is
 * refused (recorded, as without the flag) only when no block was freed for the pool's
 * wait time (tfmg_pool_set_wait; 0, the default: refused at once), or while a wait that
 * gave up is recent (a step that does not fit: see cc/tfmg/free_wait.h). For callers that
 * run beside other threads that free (TensorFlow's kernels); never with MUST_SUCCEED. */
#define TFMG_ALLOC_WAIT 16u
/* What asked for the memory, in bits 8-11 of the flags: TFMG_ALLOC_KIND(TFMG_KIND_...).
 * The pool keeps the bytes in use, and the overshoot, by kind: what holds the memory. */
#define TFMG_ALLOC_KIND_SHIFT 8
#define TFMG_ALLOC_KIND(kind) ((uint32_t)(kind) << TFMG_ALLOC_KIND_SHIFT)
#define TFMG_KIND_OTHER 0    /* unspecified */
#define TFMG_KIND_KERNEL 1   /* a kernel's output or scratch (TensorFlow can take a refusal) */
#define TFMG_KIND_TENSOR 2   /* a tensor made outside a kernel, by a path not named below */
#define TFMG_KIND_RAW 3      /* a raw buffer of the runtime (2-argument AllocateRaw) */
#define TFMG_KIND_CONSTANT 4 /* a constant made from its proto (ConstantOp, constant folding) */
#define TFMG_KIND_DATA 5     /* tf.data: elements, batches, shuffle and prefetch buffers */
#define TFMG_KIND_INPUT 6    /* numpy arrays and Python values made into tensors */
#define TFMG_KIND_XLA 7      /* XLA's buffers (jit_compile) */
#define TFMG_KIND_COPY 8     /* deep copies of tensors (constant folding's results, ...) */
#define TFMG_NUM_KINDS 9

typedef enum tfmg_upstream_kind {
  TFMG_UPSTREAM_HOST = 0,        /* page-aligned host memory (mmap for regions) */
  TFMG_UPSTREAM_CUDA = 1,        /* CUDA device memory (cuMemAlloc), driver loaded at run time */
  TFMG_UPSTREAM_CUDA_MANAGED = 2, /* CUDA managed memory, prefetched to the device */
  /* Host memory backed on demand (64 KiB granules made accessible as blocks are handed
   * out): bytes_reserved counts the memory touched. CUDA regions are backed on demand
   * too where the device has virtual memory management (TF_MEMGUARD_CUDA_VMM=0: not). */
  TFMG_UPSTREAM_HOST_ON_DEMAND = 3,
  /* The same bookkeeping without page protection (backing is bookkeeping, giving back
   * is madvise): the default of the process-wide host pools (TF_MEMGUARD_HOST_UPSTREAM). */
  TFMG_UPSTREAM_HOST_LAZY = 4
} tfmg_upstream_kind;

typedef struct tfmg_pool_options {
  /* The hard budget: the pool never reserves more than this from its upstream.
   * 0 means "no budget yet": every allocation passes straight through to the
   * upstream and is counted (see tfmg_pool_set_limit). */
  uint64_t max_bytes;
  /* Minimum alignment of every block and the granule sizes are rounded to.
   * 0 picks the upstream's default (64 bytes on host). Must be a power of two. */
  uint64_t alignment;
  /* Size of the first region reserved from the upstream; later regions double.
   * 0 picks the default, UINT64_MAX: the whole budget as one region, reserved at the
   * first allocation (on host, address space only until pages are touched). */
  uint64_t region_bytes;
  /* Requests of at least this many bytes are "large" and placed at the low end of
   * free blocks; smaller ones at the high end, which keeps long-lived small blocks
   * from pinning holes between large ones. 0 picks the default (1 MiB). */
  uint64_t small_threshold;
  /* Capacity of the trace ring buffer in events; 0 turns the trace off. */
  uint64_t trace_capacity;
  tfmg_upstream_kind upstream;
  int32_t device; /* CUDA device ordinal for the CUDA upstreams */
  /* Where the upstream backs on demand (CUDA virtual memory, host_on_demand): address
   * space reserved per byte of budget; the budget then bounds the bytes backed, and
   * free granules are taken back when it is reached. 0 picks the default (2). */
  uint64_t address_factor;
  /* Where the upstream backs on demand: when backing a block would take the bytes
   * backed above (1 + trim_above_peak) x the most bytes in use so far, free granules
   * are taken back first: fewer bytes held, at the cost of remapping. 0: off, only the
   * budget bounds them. Negative (what tfmg_pool_options_init sets): the upstream's
   * default, 0.04 on CUDA virtual memory (a reclaim there moves physical granules
   * without waiting for the device), 0 elsewhere. */
  double trim_above_peak;
  /* Host upstreams backed on demand: the granule they back in (a power of two of at least
   * a page; 0: 64 KiB, or TF_MEMGUARD_HOST_GRANULE). A replay of a GPU pool's step uses
   * the GPU's 2 MiB. */
  uint64_t granule_bytes;
  /* Requests below this many bytes take blocks from a zone of their own (regions only
   * they use), so that small blocks do not keep granules backed among large ones; only
   * where the upstream backs on demand. 0 or 1: no zones (the default). With CUDA's
   * 2 MiB granules, 65536 cut the smallest budget of random churn by 2-4% but raised
   * what a real training trace backs (benchmarks/NOTES.md). */
  uint64_t zone_threshold;
} tfmg_pool_options;

/* Statistics. The first eight fields carry TensorFlow's names and meanings
 * (tsl::AllocatorStats) so glue can copy them one by one. */
typedef struct tfmg_stats {
  int64_t num_allocs;              /* successful allocations since creation/clear */
  int64_t bytes_in_use;            /* bytes handed out and not yet freed (rounded) */
  int64_t peak_bytes_in_use;       /* maximum of bytes_in_use since creation/clear */
  int64_t largest_alloc_size;      /* largest single allocation since creation/clear */
  int64_t bytes_limit;             /* the budget; 0 when none is set */
  int64_t bytes_reserved;          /* bytes held from the upstream in pool regions */
  int64_t peak_bytes_reserved;     /* maximum of bytes_reserved */
  int64_t largest_free_block_bytes;/* largest free block inside reserved regions */
  /* tf_memguard's own. */
  int64_t num_frees;
  int64_t num_refusals;            /* requests refused for lack of budget */
  int64_t window_peak_bytes_in_use;/* peak since tfmg_pool_reset_peak (e.g. per epoch) */
  int64_t bytes_free;              /* bytes_reserved minus pooled bytes in use */
  int64_t largest_allocatable_bytes;/* largest request that could succeed now */
  int64_t num_regions;
  int64_t blocks_in_use;           /* blocks handed out and not yet freed */
  int64_t passthrough_bytes_in_use;/* handed out before a budget was set */
  int64_t overshoot_bytes_in_use;  /* MUST_SUCCEED bytes granted over the budget */
  int64_t peak_overshoot_bytes;
  int64_t num_overshoots;
  int64_t batch_bytes_in_use;      /* of bytes_in_use, blocks tagged TFMG_ALLOC_BATCH */
  int64_t window_peak_batch_bytes; /* batch-tagged bytes live at the window peak */
  int64_t window_max_batch_bytes;  /* the most batch-tagged bytes live at once in the window */
  int64_t window_in_use_at_max_batch; /* bytes in use at that moment */
  /* The window's tightest fit: of the requests the pool's regions served, the one that
   * left the least room in the largest free block (largest free block before it, minus
   * its size). How near the window came to a refusal by layout, not by bytes: a larger
   * step meets that moment with larger requests and less room. 0 when none. */
  int64_t window_tight_request_bytes;      /* that request (rounded) */
  int64_t window_tight_largest_free_bytes; /* the largest free block just before it */
  int64_t window_tight_in_use_bytes;       /* bytes in use just before it */
  /* Backed on demand: times free granules were taken back to stay within the budget
   * (on CUDA each waits for the device), and the bytes unmapped then. */
  int64_t num_reclaims;
  int64_t bytes_reclaimed;
  /* Requests with TFMG_ALLOC_WAIT that did not fit at first and waited for frees; of
   * them, those served after waiting; the time those waited, in all; the longest. */
  int64_t num_waits;
  int64_t num_waits_served;
  int64_t wait_ns;
  int64_t longest_wait_ns;
  int64_t overshoots_by_kind[TFMG_NUM_KINDS];      /* cumulative, indexed by TFMG_KIND_* */
  int64_t overshoot_bytes_by_kind[TFMG_NUM_KINDS]; /* cumulative bytes granted over budget */
  int64_t bytes_in_use_by_kind[TFMG_NUM_KINDS];    /* of bytes_in_use, by what asked for it */
  int64_t overshoot_in_use_by_kind[TFMG_NUM_KINDS];/* of overshoot_bytes_in_use, by kind */
  /* 1 - largest_free_block_bytes / bytes_free, in [0, 1); 0 when nothing is free.
   * 0 means all free memory is one block; near 1, it is in many small pieces. */
  double fragmentation;
} tfmg_stats;

/* The state at the moment a request was refused. */
typedef struct tfmg_refusal {
  uint64_t sequence;               /* 1 for the first refusal of the pool, and so on */
  int64_t requested_bytes;         /* as asked, before rounding */
  int64_t alignment;
  int64_t bytes_in_use;
  int64_t bytes_reserved;
  int64_t largest_free_block_bytes;
  int64_t largest_allocatable_bytes;
  int64_t bytes_limit;
  int64_t batch_bytes_in_use;      /* batch-tagged bytes live at the refusal */
  int64_t overshoot_bytes_in_use;  /* of bytes_in_use, granted over the budget */
  int64_t passthrough_bytes_in_use;/* of bytes_in_use, allocated before the budget */
  int32_t requested_batch;         /* 1 if the refused request was batch-tagged */
  int32_t kind;                    /* TFMG_KIND_* of the refused request */
  int64_t waited_ns;               /* how long it waited for frees before it was refused */
  int64_t bytes_in_use_by_kind[TFMG_NUM_KINDS];     /* what held the memory then */
  int64_t overshoot_in_use_by_kind[TFMG_NUM_KINDS]; /* of it, granted over the budget */
} tfmg_refusal;

typedef enum tfmg_trace_op {
  TFMG_TRACE_ALLOC = 0,
  TFMG_TRACE_FREE = 1,
  TFMG_TRACE_REFUSE = 2,
  TFMG_TRACE_OVERSHOOT = 3 /* a MUST_SUCCEED request served outside the budget */
} tfmg_trace_op;

typedef struct tfmg_trace_event {
  uint64_t sequence; /* order of the event among all events of the pool */
  uint32_t op;       /* tfmg_trace_op */
  int32_t region;    /* index of the region, -1 outside regions */
  uint64_t size;     /* bytes (rounded block size; as asked for refusals) */
  uint64_t offset;   /* offset of the block within its region */
  uint64_t address;
  uint32_t flags;    /* the request's TFMG_ALLOC_* flags (kind, batch tag, MUST_SUCCEED); frees: 0 */
  uint32_t thread;   /* which thread: 0, 1, ... in the order threads first made an event */
} tfmg_trace_event;

typedef struct tfmg_pool tfmg_pool;

TFMG_API int tfmg_abi_version(void);
TFMG_API const char* tfmg_status_string(tfmg_status status);
/* The message of the last failed call on this thread ("" if none). */
TFMG_API const char* tfmg_last_error(void);

TFMG_API void tfmg_pool_options_init(tfmg_pool_options* options);
TFMG_API tfmg_status tfmg_pool_create(const tfmg_pool_options* options, tfmg_pool** out);
/* Fails with INVALID_STATE if blocks are still in use (unless force is non-zero, in
 * which case their memory is returned to the upstream anyway). Not thread-safe with
 * respect to other calls on the same pool. */
TFMG_API tfmg_status tfmg_pool_destroy(tfmg_pool* pool, int force);

/* Statuses: OK; INVALID_ARGUMENT (alignment not a power of two, or above 1 GiB);
 * OUT_OF_MEMORY (over budget, recorded as a refusal, no counter changes otherwise);
 * UPSTREAM (the upstream failed). A request of 0 bytes gets a unique block of one
 * granule, freed like any other. */
TFMG_API tfmg_status tfmg_pool_allocate(tfmg_pool* pool, uint64_t bytes, uint64_t alignment,
                                        uint32_t flags, void** out);
/* Statuses: OK; UNKNOWN_POINTER; DOUBLE_FREE. A null pointer is OK and does nothing.
 * On error nothing changes. *size_out (optional) receives the block's size. */
TFMG_API tfmg_status tfmg_pool_deallocate(tfmg_pool* pool, void* ptr, uint64_t* size_out);
/* The size of the block at ptr (rounded), or UNKNOWN_POINTER. */
TFMG_API tfmg_status tfmg_pool_block_size(tfmg_pool* pool, const void* ptr, uint64_t* out);

/* Sets or changes the budget. Raising it always works; lowering it gives back free
 * memory first (empty regions; where the upstream backs on demand, the granules inside
 * free blocks), and fails with OUT_OF_MEMORY (leaving the old limit) only if what stays
 * held under blocks in use does not fit the new budget. INVALID_ARGUMENT for 0 and for
 * budgets above TFMG_MAX_BUDGET. Setting a budget on a pass-through pool switches it to pooling;
 * blocks handed out before stay valid and are counted as passthrough bytes. */
TFMG_API tfmg_status tfmg_pool_set_limit(tfmg_pool* pool, uint64_t max_bytes);
/* The largest budget a pool takes: 32 TiB. x86-64 and AArch64 give a process 128 TiB of
 * virtual address space (47 bits), and a pool backed on demand reserves address_factor
 * (2 by default, 4 at most sensible) times its budget; a larger budget could never be
 * reserved and would overflow the int64 fields TensorFlow's statistics use. */
#define TFMG_MAX_BUDGET (UINT64_C(1) << 45)
/* Lowers (or sets) the budget at once, whatever is held: regions that cannot go back
 * because they hold blocks in use stop serving requests ("drain") and are returned to
 * the upstream when their last block is freed; until then bytes_reserved counts them,
 * the budget does not. For putting a budget back after it was raised for a while. */
TFMG_API tfmg_status tfmg_pool_set_limit_draining(tfmg_pool* pool, uint64_t max_bytes);
/* How long a request with TFMG_ALLOC_WAIT that does not fit waits without any block
 * freed before it is refused, in nanoseconds (0: refused at once, the default). Thread-safe. */
TFMG_API tfmg_status tfmg_pool_set_wait(tfmg_pool* pool, int64_t idle_ns);
TFMG_API int64_t tfmg_pool_wait(tfmg_pool* pool);
/* The step whose wait gave up has unwound (the call that ran it returned): requests that
 * do not fit wait again at once, where they would otherwise be refused at once until none
 * was refused for the wait time. Thread-safe. */
TFMG_API tfmg_status tfmg_pool_end_failed_wait(tfmg_pool* pool);

TFMG_API tfmg_status tfmg_pool_get_stats(tfmg_pool* pool, tfmg_stats* out);
/* As TensorFlow's ClearStats: num_allocs and largest_alloc_size to 0, the peaks to the
 * current values. */
TFMG_API tfmg_status tfmg_pool_clear_stats(tfmg_pool* pool);
/* Only the window peak, to the current bytes_in_use. */
TFMG_API tfmg_status tfmg_pool_reset_peak(tfmg_pool* pool);
/* The most recent refusal; INVALID_STATE if there was none. */
TFMG_API tfmg_status tfmg_pool_last_refusal(tfmg_pool* pool, tfmg_refusal* out);
/* Returns every region that holds no block in use to the upstream, and the pages
 * inside free blocks of the other regions to the operating system (host). 
 * *released_bytes (optional) receives the bytes of regions returned. */
TFMG_API tfmg_status tfmg_pool_release_unused(tfmg_pool* pool, uint64_t* released_bytes);

/* Copies up to capacity of the oldest retained trace events into events; *count gets
 * the number copied, *dropped (optional) the number of events lost to the bound. */
TFMG_API tfmg_status tfmg_pool_trace(tfmg_pool* pool, tfmg_trace_event* events,
                                     uint64_t capacity, uint64_t* count, uint64_t* dropped);
TFMG_API tfmg_status tfmg_pool_trace_clear(tfmg_pool* pool);
/* Clears the trace and records from now on, keeping up to `capacity` events (0: stops
 * recording; the events kept stay readable). For recording one training step. */
TFMG_API tfmg_status tfmg_pool_trace_start(tfmg_pool* pool, uint64_t capacity);

/* A block in use, as tfmg_pool_live_blocks lists it. */
typedef struct tfmg_live_block {
  uint64_t address;
  uint64_t size;    /* rounded */
  uint32_t flags;   /* its request's kind and batch tag; TFMG_ALLOC_MUST_SUCCEED for overshoot */
  int32_t region;   /* -1 for overshoot (outside the regions) */
  uint64_t offset;  /* within its region */
} tfmg_live_block;
/* The blocks in use under the budget (pooled and overshoot; not pass-through), in
 * address order; *count gets how many there are (up to capacity are copied; capacity 0
 * only counts). */
TFMG_API tfmg_status tfmg_pool_live_blocks(tfmg_pool* pool, tfmg_live_block* out, uint64_t capacity,
                                           uint64_t* count);

/* Walks every invariant of the pool (expensive: O(blocks)). OK, or INVALID_STATE with
 * tfmg_last_error() naming the first broken invariant. */
TFMG_API tfmg_status tfmg_pool_check(tfmg_pool* pool);

/* How a pool places and backs blocks: what a replay of its steps needs to place them
 * alike (tfmg_replay_step). */
typedef struct tfmg_pool_layout {
  uint64_t alignment;        /* the granule every block size is a multiple of */
  uint64_t page_bytes;       /* regions' unit; where backed on demand, the backing granule */
  uint64_t small_threshold;
  uint64_t address_factor;
  uint64_t zone_threshold;   /* 0: no zones */
  int32_t backs_on_demand;
  int32_t upstream;          /* tfmg_upstream_kind */
} tfmg_pool_layout;
TFMG_API tfmg_status tfmg_pool_get_layout(tfmg_pool* pool, tfmg_pool_layout* out);

/* The memory of the pool's device (host: physical memory or the cgroup limit). */
TFMG_API uint64_t tfmg_pool_total_memory(tfmg_pool* pool);

/* Process-wide pools, one per device name ("CPU:0"), shared by every user of this copy
 * of the core (the TensorFlow plugin and the Python module). Created on first use with
 * no budget (pass-through, counted) over host memory; never destroyed. */
TFMG_API tfmg_status tfmg_device_pool(const char* device, tfmg_pool** out);
/* Creates the process-wide pool of `device` with `options` (e.g. the CUDA upstream for
 * "GPU:0"). INVALID_STATE if it exists already with another upstream; OK if it exists
 * with the same one. */
TFMG_API tfmg_status tfmg_device_pool_configure(const char* device, const tfmg_pool_options* options);
/* The pool of `device` if it exists (created or configured before); INVALID_STATE if not. */
TFMG_API tfmg_status tfmg_device_pool_find(const char* device, tfmg_pool** out);
/* 1 for the first call with a given key in this process, 0 after: lets only the first
 * of several loaded copies of the plugin register with TensorFlow. */
TFMG_API int tfmg_claim_once(const char* key);

/* The batch size being profiled (0: none). While it is set, the TensorFlow plugin
 * tags kernel allocations whose first dimension equals it with TFMG_ALLOC_BATCH. */
TFMG_API void tfmg_set_profile_batch(int64_t batch_size);
TFMG_API int64_t tfmg_profile_batch(void);

/* What the TensorFlow plugin did, for Python to report (bit flags). */
#define TFMG_PLUGIN_LOADED 1         /* the plugin found this core */
#define TFMG_PLUGIN_REGISTERED 2     /* its allocator factory is registered with TF */
#define TFMG_PLUGIN_SERVING 4        /* TF created the allocator: tensors come from the pool */
#define TFMG_PLUGIN_DISABLED 8       /* TF_MEMGUARD_DISABLE=1: did nothing */
#define TFMG_PLUGIN_DUPLICATE 16     /* another copy registered first */
#define TFMG_PLUGIN_GPU_HOOK 32      /* TF's GPUProcessState is tf_memguard's: GPU budgets work */
#define TFMG_PLUGIN_MISMATCH 64      /* built for another TensorFlow: the glue was not loaded */
#define TFMG_PLUGIN_GLUE_FAILED 128  /* the glue did not load or register (see the message) */
TFMG_API void tfmg_plugin_set_state(int flags); /* ORs flags in */
TFMG_API int tfmg_plugin_state(void);
/* Why the plugin does not serve TensorFlow, as it warned at `import tensorflow` ("" if
 * it does): for tf_memguard.install() to raise with the same words. */
TFMG_API void tfmg_plugin_set_message(const char* message);
TFMG_API const char* tfmg_plugin_message(void);
/* The path the plugin was loaded from ("" if none). */
TFMG_API void tfmg_plugin_set_path(const char* path);
TFMG_API const char* tfmg_plugin_path(void);

/* Writes a one-line description of the pool's state (sizes in human units) into buf. */
TFMG_API void tfmg_pool_describe(tfmg_pool* pool, char* buf, uint64_t buf_size);

/* Trace replay, for benchmarks: ops are applied in order; an allocation stores its
 * pointer in slots[slot], a free releases slots[slot]. Only the loop over the ops is
 * timed. The replay stops at the first allocation that fails (failed_at is its index,
 * UINT64_MAX if none did) and frees whatever it still holds before returning. */
typedef struct tfmg_replay_op {
  uint64_t size;   /* bytes to allocate; ignored for frees */
  uint32_t slot;
  uint32_t is_free;
} tfmg_replay_op;

typedef struct tfmg_replay_result {
  uint64_t elapsed_ns;
  uint64_t completed;
  uint64_t failed_at;
} tfmg_replay_result;

/* A training step for tfmg_replay_step: an allocation of `size` with `flags` (its
 * request's TFMG_ALLOC_* flags: MUST_SUCCEED requests become overshoot where they do not
 * fit) stored in slots[slot], or, with TFMG_STEP_FREE in flags, a free of slots[slot]. */
#define TFMG_STEP_FREE (1u << 31)
typedef struct tfmg_step_op {
  uint64_t size;
  uint32_t slot;
  uint32_t flags;
} tfmg_step_op;

typedef struct tfmg_step_result {
  int32_t fits;                /* 1 when no request that can be refused was */
  int32_t reserved;
  uint64_t failed_at;          /* index of the first refused op, UINT64_MAX if none */
  int64_t peak_bytes_reserved; /* the most the budget held (bytes backed, where on demand) */
  int64_t peak_account;        /* the most pooled bytes in use plus overshoot */
  int64_t peak_overshoot;      /* the most granted over the budget at once */
  int64_t blocks_at_peak;      /* blocks in use when the account peaked */
  int64_t large_blocks_at_peak;/* of them, at least the pool's small_threshold (placed low, each
                                * with granules of its own at its ends) */
  int64_t slack_at_peak;       /* bytes reserved beyond the account then (granules partly used) */
} tfmg_step_result;

/* Replays ops (a step, the blocks live at its start first) through a fresh pool made
 * with `options` (its max_bytes the budget asked about), the pool's own placement and
 * backing code, and stops at the first refusal. The upstream should back on demand
 * (host_lazy: bookkeeping only, no memory is touched) or be plain host memory. */
TFMG_API tfmg_status tfmg_replay_step(const tfmg_pool_options* options, const tfmg_step_op* ops, uint64_t count,
                                      uint64_t slots, tfmg_step_result* result);

TFMG_API tfmg_status tfmg_replay_pool(tfmg_pool* pool, const tfmg_replay_op* ops, uint64_t count,
                                      uint64_t slots, tfmg_replay_result* result);
/* The same trace through posix_memalign/free, as a baseline. */
TFMG_API tfmg_status tfmg_replay_system(const tfmg_replay_op* ops, uint64_t count, uint64_t slots,
                                        uint64_t alignment, tfmg_replay_result* result);

#ifdef __cplusplus
}
#endif

#endif /* TFMG_C_API_H_ */
