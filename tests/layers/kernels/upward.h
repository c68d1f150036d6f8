// An upward include: kernels must not know the service.
#include "service/transport/kv_transport.h"
#include "kernels/tensor.h"
