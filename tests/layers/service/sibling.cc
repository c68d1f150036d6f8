// A sibling include: the service and the client meet only in the proto.
#include "client/device_peer.h"
#include "kvq/v1/kvq.pb.h"
#include "kernels/tensor.h"
#include "absl/status/status.h"
