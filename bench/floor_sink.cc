// The durable floor with a compiled receive path, for bench/bench_ingest.py (not part of tracestore).
//
// A gRPC C++ server (callback API, generic service) that answers any client-streaming call, such
// as the bench's `/bench.Sink/Put`, in one of two modes:
//   count                  counts the bytes of every message (the compiled transport ceiling);
//   floor PATH [MIB BUFS WRITERS]
//                          per message: one CRC-32 pass (ISA-L, zlib's polynomial) and one copy
//                          into MIB-MiB aligned buffers (BUFS of them, default 16 MiB x 3) that
//                          WRITERS threads (default 1) write to PATH with O_DIRECT; after the
//                          client half-closes, the final fdatasync, then the answer.
// Either way the answer is "<bytes> <crc>". It prints "<port> <grpc version>" on its first line.
// No parsing, validation or dedupe: what no durable design can skip, with no Python on the server.
//
// Build (Debian: libgrpc++-dev libisal-dev pkg-config):
//   g++ -O2 -std=c++17 floor_sink.cc -o floor_sink $(pkg-config --cflags --libs grpc++) -lisal
#include <fcntl.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/generic/async_generic_service.h>
#include <grpcpp/support/server_callback.h>
#include <isa-l/crc.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <iostream>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace {

struct Options {
  std::string mode, path;
  size_t buf_bytes = 16 << 20;
  int bufs = 3, writers = 1;
};
Options g_opt;

// Full buffers go to the writer threads, written ones come back; one file per stream.
class Writer {
 public:
  explicit Writer(const std::string& path) {
    fd_ = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_DIRECT, 0644);
    if (fd_ < 0) return;
    for (int i = 0; i < g_opt.bufs; i++) {
      void* b = nullptr;
      if (posix_memalign(&b, 4096, g_opt.buf_bytes) != 0) std::abort();
      free_.push_back(static_cast<char*>(b));
    }
    for (int i = 0; i < g_opt.writers; i++) threads_.emplace_back([this] { Run(); });
  }
  bool ok() const { return fd_ >= 0; }
  char* Take() {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return !free_.empty(); });
    char* b = free_.back();
    free_.pop_back();
    return b;
  }
  void Give(char* buf) {
    std::lock_guard<std::mutex> lock(mu_);
    free_.push_back(buf);
    cv_.notify_all();
  }
  void Write(char* buf, size_t n) {
    std::lock_guard<std::mutex> lock(mu_);
    full_.emplace_back(buf, n);
    cv_.notify_all();
  }
  // Waits for every write, fdatasyncs, closes; true if everything reached the disk.
  bool Finish() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      done_ = true;
      cv_.notify_all();
    }
    for (auto& t : threads_) t.join();
    bool synced = !failed_ && ::fdatasync(fd_) == 0;
    ::close(fd_);
    for (char* b : free_) std::free(b);
    return synced;
  }

 private:
  void Run() {
    for (;;) {
      std::pair<char*, size_t> job;
      off_t at;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return !full_.empty() || done_; });
        if (full_.empty()) return;
        job = full_.front();
        full_.pop_front();
        at = offset_;
        offset_ += static_cast<off_t>(job.second);
      }
      size_t n = (job.second + 4095) / 4096 * 4096;  // O_DIRECT: whole blocks (the tail zero-padded)
      std::memset(job.first + job.second, 0, n - job.second);
      if (::pwrite(fd_, job.first, n, at) != static_cast<ssize_t>(n)) failed_ = true;
      Give(job.first);
    }
  }
  int fd_ = -1;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::pair<char*, size_t>> full_;
  std::vector<char*> free_;
  std::vector<std::thread> threads_;
  off_t offset_ = 0;
  bool done_ = false;
  std::atomic<bool> failed_{false};
};

class Stream : public grpc::ServerGenericBidiReactor {
 public:
  Stream() {
    if (g_opt.mode == "floor") {
      writer_ = std::make_unique<Writer>(g_opt.path);
      if (!writer_->ok()) {
        Finish(grpc::Status(grpc::StatusCode::INTERNAL, "cannot open " + g_opt.path + " with O_DIRECT"));
        return;
      }
      buf_ = writer_->Take();
    }
    StartRead(&message_);
  }
  void OnReadDone(bool ok) override {
    if (!ok) {  // the client half-closed: make it durable, then answer
      if (writer_ != nullptr) {
        if (fill_ > 0) writer_->Write(buf_, fill_); else writer_->Give(buf_);
        if (!writer_->Finish()) {
          Finish(grpc::Status(grpc::StatusCode::INTERNAL, "write or fdatasync failed"));
          return;
        }
      }
      std::string text = std::to_string(total_) + " " + std::to_string(crc_);
      grpc::Slice slice(text);
      answer_ = grpc::ByteBuffer(&slice, 1);
      StartWrite(&answer_);
      return;
    }
    std::vector<grpc::Slice> slices;
    if (!message_.Dump(&slices).ok()) std::abort();
    for (const grpc::Slice& s : slices) {
      const uint8_t* p = s.begin();
      size_t n = s.size();
      total_ += n;
      if (writer_ == nullptr) continue;
      crc_ = crc32_gzip_refl(crc_, p, n);
      while (n > 0) {
        size_t k = std::min(n, g_opt.buf_bytes - fill_);
        std::memcpy(buf_ + fill_, p, k);
        fill_ += k;
        p += k;
        n -= k;
        if (fill_ == g_opt.buf_bytes) {
          writer_->Write(buf_, fill_);
          buf_ = writer_->Take();
          fill_ = 0;
        }
      }
    }
    message_.Clear();
    StartRead(&message_);
  }
  void OnWriteDone(bool) override { Finish(grpc::Status::OK); }
  void OnDone() override { delete this; }

 private:
  grpc::ByteBuffer message_, answer_;
  std::unique_ptr<Writer> writer_;
  char* buf_ = nullptr;
  size_t fill_ = 0, total_ = 0;
  uint32_t crc_ = 0;
};

class Service : public grpc::CallbackGenericService {
  grpc::ServerGenericBidiReactor* CreateReactor(grpc::GenericCallbackServerContext*) override {
    return new Stream();
  }
};

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2 || (std::string(argv[1]) != "count" && (std::string(argv[1]) != "floor" || argc < 3))) {
    std::cerr << "usage: floor_sink count | floor PATH [MIB BUFS WRITERS]\n";
    return 2;
  }
  g_opt.mode = argv[1];
  if (argc > 2) g_opt.path = argv[2];
  if (argc > 5) {
    g_opt.buf_bytes = std::stoul(argv[3]) << 20;
    g_opt.bufs = std::max(2, std::stoi(argv[4]));
    g_opt.writers = std::max(1, std::stoi(argv[5]));
  }
  Service service;
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.SetMaxReceiveMessageSize(64 << 20);
  builder.RegisterCallbackGenericService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || port == 0) return 1;
  std::cout << port << " " << grpc::Version() << std::endl;
  server->Wait();
}
