// Allowed: the benchmarks over everything below them.
#include "service/kvq_service.h"
#include "client/kvq_client.h"
