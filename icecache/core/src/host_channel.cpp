// The host side of the hand-off channel of a captured decode step (icecache/core/host_channel.py says how the
// stream side works). Two 32-bit words in pinned, device-mapped host memory carry every hand-off:
//
//   stream: write request = slot + 1     worker: sees it, clears it, runs entry `slot`, writes answer = slot + 1
//   stream: wait until answer == slot + 1, then write answer = 0
//
// Every value the stream writes or waits for is a constant of its slot, so a CUDA graph that recorded the three
// operations once is right at every replay. A worker thread spins on the request word (a pause instruction per
// probe; after a long idle it sleeps between probes), so a hand-off inside a running step costs microseconds and
// no driver callback thread is involved. A watchdog thread keeps the stream's wait bounded: when the worker has
// stopped, or an entry runs past the timeout, it writes the answer itself and records the error, which Python
// raises once the step has synchronised. This file calls no CUDA: the words' addresses come from Python.

#include <pybind11/pybind11.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
static inline void cpu_pause() { _mm_pause(); }
#elif defined(__aarch64__)
static inline void cpu_pause() { asm volatile("yield" ::: "memory"); }
#else
static inline void cpu_pause() {}
#endif

namespace py = pybind11;

namespace {

using Clock = std::chrono::steady_clock;

int64_t now_ns() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch()).count();
}

// A registered entry: a C function `void f(void*)` with its state, or a Python callable (owned reference).
struct Entry {
    uintptr_t function = 0;
    uintptr_t state = 0;
    PyObject* callable = nullptr;
};

// Everything both threads touch. Held by shared_ptr from each thread, so that a worker stuck in an entry (which
// close() cannot join) never outlives what it reads.
struct Core {
    uint32_t* request = nullptr;
    uint32_t* answer = nullptr;
    double timeout_s = 5.0;
    int64_t idle_before_sleep_ns = 50'000'000;

    std::mutex entries_mutex;
    std::vector<Entry> entries;

    std::atomic<bool> stopping{false};
    std::atomic<bool> worker_alive{false};
    std::atomic<bool> worker_stuck{false};  // an entry ran past the timeout: the watchdog answers while it runs
    std::atomic<bool> in_entry{false};      // the worker is running an entry
    std::atomic<bool> failed{false};
    std::atomic<uint32_t> pending{0};  // the request the worker took and has not answered (0: none)
    std::atomic<int64_t> pending_since_ns{0};
    std::atomic<int64_t> stop_after{-1};  // test hook: the worker stops on taking this many more requests
    std::atomic<uint64_t> served{0};

    std::mutex error_mutex;
    std::string error;
    PyObject* exception = nullptr;  // the first Python exception an entry raised (owned reference)

    // The worker's Python thread state, made at its first Python entry and kept, so that thread-local Python
    // state (torch's inference mode, the in-host-function flag) costs nothing per hand-off.
    PyThreadState* thread_state = nullptr;
    PyGILState_STATE gil_state{};

    uint32_t load_request() const { return __atomic_load_n(request, __ATOMIC_ACQUIRE); }

    // Take request `value` off the word; only one of the worker and the watchdog can.
    bool take(uint32_t value) {
        uint32_t expected = value;
        return __atomic_compare_exchange_n(request, &expected, 0u, false, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
    }

    // Answer the request taken as `value`, unless the watchdog answered it already (an entry past the timeout).
    void finish(uint32_t value) {
        uint32_t expected = value;
        if (pending.compare_exchange_strong(expected, 0u)) {
            served.fetch_add(1);
            __atomic_store_n(answer, value, __ATOMIC_RELEASE);
        }
    }

    void fail(const std::string& message) {
        std::lock_guard<std::mutex> lock(error_mutex);
        if (error.empty()) error = message;
        failed.store(true);
    }

    // Called with the GIL held and a Python error set.
    void fail_with_python_error(size_t slot) {
        PyObject *type = nullptr, *value = nullptr, *traceback = nullptr;
        PyErr_Fetch(&type, &value, &traceback);
        PyErr_NormalizeException(&type, &value, &traceback);
        if (value != nullptr && traceback != nullptr) PyException_SetTraceback(value, traceback);
        std::string message = "entry " + std::to_string(slot) + " raised an exception";
        if (value != nullptr) {
            PyObject* text = PyObject_Repr(value);
            if (text != nullptr) {
                const char* utf8 = PyUnicode_AsUTF8(text);
                if (utf8 != nullptr) message = utf8;
                Py_DECREF(text);
            }
            PyErr_Clear();
        }
        {
            std::lock_guard<std::mutex> lock(error_mutex);
            if (error.empty()) {
                error = message;
                exception = value;
                value = nullptr;
            }
        }
        failed.store(true);
        Py_XDECREF(type);
        Py_XDECREF(value);
        Py_XDECREF(traceback);
    }

    void run_python(size_t slot, PyObject* callable) {
        if (thread_state == nullptr) {
            gil_state = PyGILState_Ensure();
            thread_state = PyThreadState_Get();
        } else {
            PyEval_RestoreThread(thread_state);
        }
        Py_INCREF(callable);  // held for the call: release_callables may drop the entry's own reference
        PyObject* result = PyObject_CallObject(callable, nullptr);
        if (result == nullptr) {
            fail_with_python_error(slot);
        } else {
            Py_DECREF(result);
        }
        Py_DECREF(callable);
        thread_state = PyEval_SaveThread();
    }

    void run(size_t slot) {
        Entry entry;
        {
            std::lock_guard<std::mutex> lock(entries_mutex);
            if (slot >= entries.size()) {
                fail("a hand-off asked for entry " + std::to_string(slot) + ", which was never registered");
                return;
            }
            entry = entries[slot];
        }
        try {
            if (entry.callable != nullptr) {
                run_python(slot, entry.callable);
            } else {
                reinterpret_cast<void (*)(void*)>(entry.function)(reinterpret_cast<void*>(entry.state));
            }
        } catch (const std::exception& error) {
            fail("native entry " + std::to_string(slot) + " threw: " + error.what());
        } catch (...) {
            fail("native entry " + std::to_string(slot) + " threw an exception");
        }
    }

    void release_thread_state() {
        if (thread_state != nullptr) {
            PyEval_RestoreThread(thread_state);
            thread_state = nullptr;
            PyGILState_Release(gil_state);
        }
    }

    void worker_loop() {
        int64_t idle_since = now_ns();
        uint32_t probes = 0;
        bool dozing = false;  // idle for long: sleep between probes (a hand-off then waits ~50-100 us more)
        while (!stopping.load(std::memory_order_acquire)) {
            uint32_t value = load_request();
            if (value == 0) {
                if (dozing) {
                    std::this_thread::sleep_for(std::chrono::microseconds(50));
                } else {
                    cpu_pause();
                    // The clock is read once every 1024 probes (tens of microseconds of spinning).
                    dozing = (++probes & 1023u) == 0 && now_ns() - idle_since > idle_before_sleep_ns;
                }
                continue;
            }
            dozing = false;
            if (!take(value)) continue;
            pending_since_ns.store(now_ns(), std::memory_order_relaxed);
            pending.store(value, std::memory_order_release);
            int64_t left = stop_after.load();
            if (left > 0 && stop_after.fetch_sub(1) == 1) break;  // the test hook: stop holding the request
            if (!failed.load()) {  // after a failure the state is not to be built on: answer only
                in_entry.store(true, std::memory_order_release);
                run(value - 1);
                in_entry.store(false, std::memory_order_release);
            }
            finish(value);
            idle_since = now_ns();
            probes = 0;
        }
        release_thread_state();
        worker_alive.store(false, std::memory_order_release);
    }

    void watchdog_loop() {
        const auto poll = std::chrono::microseconds(200);
        while (!stopping.load(std::memory_order_acquire)) {
            std::this_thread::sleep_for(poll);
            bool alive = worker_alive.load(std::memory_order_acquire);
            uint32_t taken = pending.load(std::memory_order_acquire);
            if (taken != 0) {
                double waited = (now_ns() - pending_since_ns.load(std::memory_order_relaxed)) * 1e-9;
                bool late = waited > timeout_s;
                if ((!alive || late) && pending.compare_exchange_strong(taken, 0u)) {
                    std::string entry = "entry " + std::to_string(taken - 1);
                    if (alive) {
                        worker_stuck.store(true);
                        fail(entry + " ran past the hand-off timeout of " + std::to_string(timeout_s) +
                             " s; the step's later host work did not run");
                    } else {
                        fail("the host worker stopped while running " + entry +
                             "; the step's later host work did not run");
                    }
                    __atomic_store_n(answer, taken, __ATOMIC_RELEASE);
                }
                continue;
            }
            if (!alive || (worker_stuck.load() && in_entry.load(std::memory_order_acquire))) {
                // Nobody else will answer: release the stream now, with the error kept for Python.
                uint32_t value = load_request();
                if (value != 0 && take(value)) {
                    fail("the host worker was not running at a hand-off to entry " + std::to_string(value - 1));
                    __atomic_store_n(answer, value, __ATOMIC_RELEASE);
                }
            }
        }
    }
};

class Channel {
public:
    Channel(uintptr_t request_address, uintptr_t answer_address, double timeout_s, double idle_before_sleep_s)
        : core_(std::make_shared<Core>()) {
        if (request_address == 0 || answer_address == 0 || request_address == answer_address ||
            request_address % 4 != 0 || answer_address % 4 != 0) {
            throw std::invalid_argument("the hand-off words need two distinct 4-byte aligned addresses");
        }
        if (!(timeout_s > 0)) throw std::invalid_argument("the hand-off timeout must be positive");
        core_->request = reinterpret_cast<uint32_t*>(request_address);
        core_->answer = reinterpret_cast<uint32_t*>(answer_address);
        core_->timeout_s = timeout_s;
        core_->idle_before_sleep_ns = static_cast<int64_t>(idle_before_sleep_s * 1e9);
    }

    ~Channel() {
        if (running_) {
            if (PyGILState_Check()) {
                py::gil_scoped_release released;
                stop();
            } else {
                stop();
            }
        }
        release_callables();
    }

    size_t add_native(uintptr_t function, uintptr_t state) {
        if (function == 0) throw std::invalid_argument("a native entry needs a function address");
        std::lock_guard<std::mutex> lock(core_->entries_mutex);
        core_->entries.push_back(Entry{function, state, nullptr});
        return core_->entries.size() - 1;
    }

    size_t add_python(py::object callable) {
        if (!PyCallable_Check(callable.ptr())) throw std::invalid_argument("a Python entry must be callable");
        std::lock_guard<std::mutex> lock(core_->entries_mutex);
        core_->entries.push_back(Entry{0, 0, callable.release().ptr()});
        return core_->entries.size() - 1;
    }

    void start() {
        if (running_) return;
        core_->stopping.store(false);
        core_->worker_alive.store(true);
        std::shared_ptr<Core> core = core_;
        worker_ = std::thread([core] { core->worker_loop(); });
        watchdog_ = std::thread([core] { core->watchdog_loop(); });
        running_ = true;
    }

    // Stop both threads; true when both were joined (false: the worker is stuck in an entry and was left to
    // finish on its own, so the words must stay allocated). Called without the GIL.
    bool stop() {
        if (!running_) return true;
        core_->stopping.store(true, std::memory_order_release);
        watchdog_.join();
        bool joined = true;
        // A worker in an entry past the timeout gets a short grace to return, then is left to finish alone.
        for (int i = 0; i < 100 && core_->worker_stuck.load() && core_->in_entry.load(); ++i) {
            std::this_thread::sleep_for(std::chrono::milliseconds(1));
        }
        if (core_->worker_stuck.load() && core_->in_entry.load() && core_->worker_alive.load()) {
            worker_.detach();
            detached_ = true;
            joined = false;
        } else {
            worker_.join();
        }
        running_ = false;
        return joined;
    }

    bool failed() const { return core_->failed.load(); }
    bool running() const { return running_; }
    bool worker_alive() const { return core_->worker_alive.load(); }
    uint64_t served() const { return core_->served.load(); }
    size_t entries() {
        std::lock_guard<std::mutex> lock(core_->entries_mutex);
        return core_->entries.size();
    }

    py::object error() {
        std::lock_guard<std::mutex> lock(core_->error_mutex);
        if (core_->error.empty()) return py::none();
        return py::str(core_->error);
    }

    py::object exception() {
        std::lock_guard<std::mutex> lock(core_->error_mutex);
        if (core_->exception == nullptr) return py::none();
        return py::reinterpret_borrow<py::object>(core_->exception);
    }

    void stop_worker_after(int64_t requests) {
        if (requests < 1) throw std::invalid_argument("stop_worker_after counts requests from 1");
        core_->stop_after.store(requests);
    }

    // Drop the Python entries and the error; only once the threads are stopped. Called with the GIL.
    void release_callables() {
        if (running_) throw std::runtime_error("stop the channel before releasing its entries");
        std::vector<Entry> entries;
        {
            std::lock_guard<std::mutex> lock(core_->entries_mutex);
            entries.swap(core_->entries);
        }
        // A worker left running in an entry may still call any of them: those references are kept for good.
        if (detached_ || !Py_IsInitialized()) return;
        for (Entry& entry : entries) Py_XDECREF(entry.callable);
        std::lock_guard<std::mutex> lock(core_->error_mutex);
        Py_XDECREF(core_->exception);
        core_->exception = nullptr;
    }

private:
    std::shared_ptr<Core> core_;
    std::thread worker_;
    std::thread watchdog_;
    bool running_ = false;
    bool detached_ = false;
};

}  // namespace

// Native entries of the extension itself, for tests and the hand-off probe: `count` adds one to the uint64 its
// state points at; `sleep_us` sleeps for the microseconds in the uint64 its state points at.
extern "C" void icecache_handoff_count(void* state) {
    __atomic_add_fetch(reinterpret_cast<uint64_t*>(state), 1, __ATOMIC_RELAXED);
}

extern "C" void icecache_handoff_sleep_us(void* state) {
    std::this_thread::sleep_for(std::chrono::microseconds(*reinterpret_cast<uint64_t*>(state)));
}

PYBIND11_MODULE(_host_channel, m) {
    m.doc() = "The host side of the stream-memory hand-off channel (request word -> worker -> answer word).";
    py::class_<Channel>(m, "Channel")
        .def(py::init<uintptr_t, uintptr_t, double, double>(), py::arg("request_address"),
             py::arg("answer_address"), py::arg("timeout_s"), py::arg("idle_before_sleep_s"))
        .def("add_native", &Channel::add_native, py::arg("function_address"), py::arg("state_address"))
        .def("add_python", &Channel::add_python, py::arg("callable"))
        .def("start", &Channel::start)
        .def("stop", &Channel::stop, py::call_guard<py::gil_scoped_release>())
        .def("release_callables", &Channel::release_callables)
        .def("stop_worker_after", &Channel::stop_worker_after, py::arg("requests"))
        .def_property_readonly("failed", &Channel::failed)
        .def_property_readonly("running", &Channel::running)
        .def_property_readonly("worker_alive", &Channel::worker_alive)
        .def_property_readonly("served", &Channel::served)
        .def_property_readonly("entries", &Channel::entries)
        .def("error", &Channel::error)
        .def("exception", &Channel::exception);
    m.def("count_entry_address", [] { return reinterpret_cast<uintptr_t>(&icecache_handoff_count); });
    m.def("sleep_entry_address", [] { return reinterpret_cast<uintptr_t>(&icecache_handoff_sleep_us); });
}
