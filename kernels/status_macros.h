// Status helpers missing from the Abseil that Debian ships.
#ifndef KVQ_KERNELS_STATUS_MACROS_H_
#define KVQ_KERNELS_STATUS_MACROS_H_

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define KVQ_CONCAT_INNER_(a, b) a##b
#define KVQ_CONCAT_(a, b) KVQ_CONCAT_INNER_(a, b)

// Returns from the enclosing function when `expr` is not OK.
#define KVQ_RETURN_IF_ERROR(expr)                  \
  do {                                             \
    if (::absl::Status kvq_status_ = (expr);       \
        !kvq_status_.ok()) {                       \
      return kvq_status_;                          \
    }                                              \
  } while (0)

// `lhs = value of expr` when expr is OK, else returns its status.
#define KVQ_ASSIGN_OR_RETURN(lhs, expr)                                  \
  KVQ_ASSIGN_OR_RETURN_IMPL_(KVQ_CONCAT_(kvq_statusor_, __LINE__), lhs, \
                             expr)
#define KVQ_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                               \
  if (!tmp.ok()) return std::move(tmp).status();   \
  lhs = std::move(tmp).value()

#endif  // KVQ_KERNELS_STATUS_MACROS_H_
