// Which TensorFlow path asks for memory, read from the calling thread's stack.
//
// TensorFlow's allocator interface says little about a request: a kernel's comes with
// AllocationAttributes::allocation_will_be_logged, everything else looks alike. Whether
// a null is survivable depends on the caller (benchmarks/NOTES.md, "Which requests can
// be refused"), so when an unlogged request does not fit the budget, the glue asks here
// who made it. No TensorFlow headers: names are matched in the mangled symbols of the
// frames (dladdr), and each return address is looked up once and cached, so a walk
// costs a backtrace() and a few table lookups.
#ifndef TFMG_TF_CALLER_H_
#define TFMG_TF_CALLER_H_

#include <cstddef>
#include <string>

namespace tfmg_tf {

struct caller {
  unsigned kind = 0;       // TFMG_KIND_* of the path (TENSOR or RAW when none is known)
  bool refusable = false;  // the path turns a null into an error status, and goes on
  bool onednn = false;     // a oneDNN (Mkl*) kernel is on the stack
  // A kernel that loses what it made when its output cannot be allocated: tf.data's
  // DatasetOpKernel::Compute makes the dataset (holding its input tensors) before it
  // allocates the scalar that would own it, and leaks it on a refusal (seen with TF
  // 2.21: a 469 MiB copy of fit()'s arrays stayed in use for the rest of the process).
  bool leaks_on_refusal = false;
};

// `fallback`: the kind when no frame names a known path (TFMG_KIND_TENSOR for 3-argument
// AllocateRaw, TFMG_KIND_RAW for the 2-argument one, whose callers never check).
caller classify_caller(unsigned fallback);

// "tensorflow::Tensor::FromProto < tensorflow::ConstantOp::ConstantOp < ...": the named
// frames of the calling stack, demangled, for TF_MEMGUARD_LOG_UNREFUSABLE.
std::string describe_stack(int frames);

}  // namespace tfmg_tf

#endif  // TFMG_TF_CALLER_H_
