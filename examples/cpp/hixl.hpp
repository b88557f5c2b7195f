// examples/cpp/hixl.hpp: a small RAII wrapper over hixl's C API (header only).
// Errors become hixl::Error exceptions carrying the status code; engines, registrations and
// requests free themselves.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "hixl.h"

namespace hixl {

struct Error : std::runtime_error {
    uint32_t code;
    Error(uint32_t c, const std::string &what) : std::runtime_error(what), code(c) {}
};

inline void check(uint32_t rc, const char *call) {
    if (rc != HIXL_SUCCESS) throw Error(rc, std::string(call) + ": " + hixl_last_error());
}

class Request {
  public:
    explicit Request(HixlRequest *r) : r_(r, hixl_request_free) {}
    // Waits until it ends (or `timeout_ms`); throws its error unless it completed.
    void wait(uint64_t timeout_ms = HIXL_TIMEOUT_DEFAULT) {
        uint32_t state = 0;
        check(hixl_request_wait(r_.get(), timeout_ms, &state), "hixl_request_wait");
        check(hixl_request_result(r_.get()), "transfer");
    }
    uint32_t status() const { return hixl_request_status(r_.get()); }

  private:
    std::unique_ptr<HixlRequest, void (*)(HixlRequest *)> r_;
};

class Engine {
  public:
    // A registered range, deregistered when it goes out of scope.
    class Registration {
      public:
        Registration(HixlEngine *e, HixlMemHandle h) : e_(e), h_(h) {}
        Registration(Registration &&o) noexcept : e_(o.e_), h_(o.h_) { o.e_ = nullptr; }
        Registration(const Registration &) = delete;
        ~Registration() {
            if (e_) hixl_deregister(e_, &h_);
        }

      private:
        HixlEngine *e_;
        HixlMemHandle h_;
    };

    Engine(const std::string &local, const std::vector<std::pair<std::string, std::string>> &opts = {})
        : e_(hixl_engine_new(), hixl_engine_free) {
        std::vector<const char *> k, v;
        for (auto &kv : opts) k.push_back(kv.first.c_str()), v.push_back(kv.second.c_str());
        check(hixl_initialize(e_.get(), local.c_str(), k.data(), v.data(), k.size()), "hixl_initialize");
    }
    std::string local_engine() const {
        char buf[128];
        size_t len = 0;
        check(hixl_local_engine(e_.get(), buf, sizeof buf, &len), "hixl_local_engine");
        return std::string(buf, len);
    }
    Registration register_mem(void *p, size_t n, const char *name = nullptr, uint32_t access = HIXL_ACCESS_RW) {
        HixlMemHandle h;
        check(hixl_register(e_.get(), reinterpret_cast<uintptr_t>(p), n, access, name, &h), "hixl_register");
        return Registration(e_.get(), h);
    }
    void connect(const std::string &remote, uint64_t timeout_ms = HIXL_TIMEOUT_DEFAULT) {
        check(hixl_connect(e_.get(), remote.c_str(), timeout_ms), "hixl_connect");
    }
    HixlRemoteRegion remote_region(const std::string &remote, const std::string &name) {
        HixlRemoteRegion r;
        check(hixl_remote_region(e_.get(), remote.c_str(), name.c_str(), &r), "hixl_remote_region");
        return r;
    }
    Request transfer_async(const std::string &remote, uint32_t op, const std::vector<HixlDesc> &d) {
        HixlRequest *r = nullptr;
        check(hixl_transfer_async(e_.get(), remote.c_str(), op, d.data(), d.size(), nullptr, nullptr,
                                  HIXL_TIMEOUT_DEFAULT, &r),
              "hixl_transfer_async");
        return Request(r);
    }
    void get(const std::string &remote, void *local, uint64_t remote_addr, size_t n) {
        check(hixl_get(e_.get(), remote.c_str(), reinterpret_cast<uintptr_t>(local), remote_addr, n,
                       HIXL_TIMEOUT_DEFAULT),
              "hixl_get");
    }
    void send_notify(const std::string &remote, const std::string &name, const std::string &msg) {
        check(hixl_send_notify(e_.get(), remote.c_str(), name.c_str(), msg.c_str(), HIXL_TIMEOUT_DEFAULT),
              "hixl_send_notify");
    }
    // Waits for a notification named `name`; returns its message.
    std::string wait_notify(const std::string &name, uint64_t timeout_ms) {
        std::string msg;
        auto cb = [](void *ctx, const char *, const char *m) { *static_cast<std::string *>(ctx) = m; };
        check(hixl_wait_notifies(e_.get(), timeout_ms, name.c_str(), cb, &msg), "hixl_wait_notifies");
        return msg;
    }

  private:
    std::unique_ptr<HixlEngine, void (*)(HixlEngine *)> e_;
};

}  // namespace hixl
