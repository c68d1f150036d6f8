// KvqService::DoMatchPrefix: the read-only prefix probe (MatchPrefixRequest
// in the proto). It reads the store's prefix registry and nothing else.
#include "kernels/status_macros.h"
#include "service/kvq_service.h"
#include "service/sequence_args.h"

namespace kvq {

absl::Status KvqService::DoMatchPrefix(const v1::MatchPrefixRequest& req,
                                       v1::MatchPrefixResponse* resp, absl::string_view tenant) {
  KVQ_ASSIGN_OR_RETURN(CreateSequenceArgs args,
                       SequenceArgsFromWire(tenant, req.namespace_(), req.layout(), req.scheme(),
                                            req.codebooks(), req.calibration(), calibrations_,
                                            req.prompt_token_ids()));
  int block_tokens = 0;
  KVQ_ASSIGN_OR_RETURN(int matched, store_->MatchPrefix(args, &block_tokens));
  resp->set_matched_tokens(matched);
  resp->set_block_tokens(block_tokens);
  return absl::OkStatus();
}

}  // namespace kvq
