"""kvq.client: the client of a kvq server over gRPC, the `kvq_client`
package under this name (KvqClient, ShardedClient, ...; the vLLM connector
stays at kvq_client.vllm_connector)."""

from kvq_client import *  # noqa: F401,F403
from kvq_client import __all__  # noqa: F401
