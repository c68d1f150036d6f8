// An in-process fake of both device payload paths, for tests on the CPU:
// host memory stands in for device memory, a table of exported buffers for
// CUDA IPC handles, and byte queues for NCCL sessions. The server side
// (FakeKvTransport) is a real KvTransport behind the real RPC handlers; the
// client side (FakeDevicePeer) is a real DevicePeer for the C++ client.
// Faults are injected on the hub: the peer vanishes mid-transfer, never
// delivers, or delivers a short payload.
//
// Test-only: nothing outside tests/ can select it.
#ifndef KVQ_TESTS_TRANSPORT_FAKE_TRANSPORT_H_
#define KVQ_TESTS_TRANSPORT_FAKE_TRANSPORT_H_

#include <cstdint>
#include <deque>
#include <string>

#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "client/device_peer.h"
#include "service/transport/kv_transport.h"

namespace kvq {

class FakeTransportHub {
 public:
  enum class Fault {
    kNone,
    kPeerVanishes,  // Half the bytes move, then the peer is gone: UNAVAILABLE.
    kNeverArrives,  // The peer never delivers or takes the bytes: DEADLINE_EXCEEDED.
    kShortPayload,  // The peer's payload is one byte short: INVALID_ARGUMENT.
  };
  // Every later transfer of the payload `field` ("k", "v"; "" for both)
  // misbehaves as `fault`.
  void set_fault(Fault fault, std::string field = "");

  // --- CUDA IPC stand-in: "handles" name host buffers.
  std::string Export(const void* data, size_t size);
  void Unexport(const std::string& handle);

  // --- Session stand-in: a queue of byte messages each way.
  SessionDescriptor OpenSession();
  void CloseSession(absl::string_view id);
  absl::Status Push(absl::string_view id, bool to_server, std::string bytes);
  // Waits for the next message for `to_server`'s side until `deadline`.
  absl::StatusOr<std::string> Pop(absl::string_view id, bool to_server, absl::Time deadline);

  // What the server side applies to a payload.
  Fault FaultFor(absl::string_view field);
  struct Buffer {
    const void* data = nullptr;
    size_t size = 0;
  };
  absl::StatusOr<Buffer> Lookup(const PayloadRef& ref);
  int open_sessions();

 private:
  struct Session {
    std::deque<std::string> to_server, to_client;
  };
  absl::Mutex mu_;
  Fault fault_ ABSL_GUARDED_BY(mu_) = Fault::kNone;
  std::string fault_field_ ABSL_GUARDED_BY(mu_);
  int next_id_ ABSL_GUARDED_BY(mu_) = 0;
  absl::flat_hash_map<std::string, Buffer> exports_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, Session> sessions_ ABSL_GUARDED_BY(mu_);
};

// The server's side.
class FakeKvTransport : public KvTransport {
 public:
  FakeKvTransport(FakeTransportHub* hub, TransportKind kind) : hub_(hub), kind_(kind) {}
  TransportKind kind() const override { return kind_; }
  absl::StatusOr<SessionDescriptor> OpenSession(absl::Time deadline) override;
  void CloseSession(absl::string_view session_id) override;
  absl::Status Receive(const PayloadRef& ref, absl::Span<uint8_t> dst,
                       absl::Time deadline) override;
  absl::Status Send(const PayloadRef& ref, absl::Span<const uint8_t> src,
                    absl::Time deadline) override;

 private:
  FakeTransportHub* hub_;
  TransportKind kind_;
};

// The client's side: "device memory" is host memory.
class FakeDevicePeer : public DevicePeer {
 public:
  FakeDevicePeer(FakeTransportHub* hub, PayloadTransport kind) : hub_(hub), kind_(kind) {}
  PayloadTransport kind() const override { return kind_; }
  // Exports the buffer registered with Register() that holds `ptr`.
  absl::StatusOr<IpcExport> Export(const void* ptr) override;
  absl::Status Join(const SessionJoin& join, absl::Time deadline) override;
  absl::Status Send(const void* ptr, int64_t size, absl::Time deadline) override;
  absl::Status Recv(void* ptr, int64_t size, absl::Time deadline) override;
  void Leave() override { session_.clear(); }

  // The "device allocations" Export() may name (as cudaMalloc's).
  void Register(const void* data, size_t size);
  const std::string& session() const { return session_; }

 private:
  FakeTransportHub* hub_;
  PayloadTransport kind_;
  std::string session_;
  struct Allocation {
    const uint8_t* data;
    size_t size;
    std::string handle;
  };
  std::vector<Allocation> allocations_;
};

}  // namespace kvq

#endif  // KVQ_TESTS_TRANSPORT_FAKE_TRANSPORT_H_
