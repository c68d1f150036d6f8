// Allowed: the client on the kernels, the proto and synthetic data.
#include "kernels/tensor.h"
#include "kvq/v1/kvq.grpc.pb.h"
#include "synthetic/synthetic_kv.h"
#include "client/kvq_client.h"
