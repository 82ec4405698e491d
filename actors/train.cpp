// actors/train.cpp -- process bootstrap of a training run (controller node or remote node).
#include "actors/train.hpp"

#include <caf/all.hpp>
#include <caf/io/all.hpp>

#include <algorithm>
#include <charconv>
#include <chrono>
#include <csignal>
#include <condition_variable>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <future>
#include <iterator>
#include <optional>
#include <set>
#include <sstream>
#include <nlohmann/json.hpp>
#include <thread>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include "actors/actors.hpp"
#include "actors/preflight.hpp"
#include "actors/run_dir.hpp"
#include "actors/signals.hpp"
#include "actors/trace.hpp"
#include "models/checkpoint.hpp"
#include "models/generate.hpp"
#include "models/json_io.hpp"
#include "models/log.hpp"
#include "models/params.hpp"

namespace fp8rl::actors {
namespace {
// Whether a TCP port is taken on this machine (bind on any address fails with EADDRINUSE): what
// CAF's "tcp socket creation failed" did not say.
bool port_in_use(uint16_t port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return false;
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(port);
  a.sin_addr.s_addr = htonl(INADDR_ANY);
  const bool used = port != 0 && ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 && errno == EADDRINUSE;
  ::close(fd);
  return used;
}

namespace fs = std::filesystem;
using json = nlohmann::json;

// ---------------------------------------------------------------- process-wide agent signal
std::mutex g_mu;
std::condition_variable g_cv;
bool g_agent_started = false, g_agent_done = false;
bool g_agent_asked = false;   // the controller's start reached the agent
caf::actor_addr g_agent;      // this process's node agent (weak: stopped when the controller never starts it)
std::string g_agent_failure;  // why the agent stopped, if not by the controller's stop
std::string g_node_name;      // this process's topology node (set before its port opens)
msg::controller_actor g_controller;  // the controller a node agent was started by (a node's stop request goes there)

void agent_signal(bool started, bool done, const std::string& failure = "", const caf::actor_addr& agent = {}) {
  std::lock_guard<std::mutex> g(g_mu);
  if (started) g_agent = agent;  // with `started`, under one lock: the wait loop sees both or neither
  g_agent_started |= started;
  g_agent_done |= done;
  if (g_agent_failure.empty()) g_agent_failure = failure;
  g_cv.notify_all();
}

struct agent_state {
  msg::node_actors spawned;
};

// Spawns the actors a node hosts (its singleton roles, learners and rollouts).
msg::node_actors spawn_node(caf::actor_system& sys, const node_spec& n, std::shared_ptr<const actor_env> env,
                            int32_t first_learner, int32_t world, int32_t first_rollout) {
  msg::node_actors out;
  const device_spec learner_dev = n.learners.empty() ? device_spec{} : n.learners.front();
  if (n.has("buffer")) out.buffer = spawn_buffer(sys, env);
  if (n.has("reward")) out.reward = spawn_reward(sys, env);
  if (n.has("weight_sync")) out.weight_sync = spawn_weight_sync(sys, env);
  if (n.has("calibration")) out.calibration = spawn_calibration(sys, env, learner_dev);
  for (size_t i = 0; i < n.learners.size(); ++i)
    out.learners.push_back(spawn_learner(sys, env, first_learner + static_cast<int32_t>(i), world, n.learners[i]));
  for (size_t i = 0; i < n.rollouts.size(); ++i) {
    out.rollout_names.push_back(rollout_name(first_rollout + static_cast<int64_t>(i)));
    out.rollouts.push_back(spawn_rollout(sys, env, out.rollout_names.back(), n.rollouts[i]));
  }
  return out;
}

// Test hook (the controller's check of a node's answer): with FP8RL_FAULT_NODE_ANSWER=rename in
// the environment, a node agent answers with its first rollout misnamed, as another build could.
msg::node_actors node_answer(const msg::node_actors& x) {
  static const char* const fault = std::getenv("FP8RL_FAULT_NODE_ANSWER");  // read once
  if (!fault) return x;
  if (std::string(fault) != "rename") throw std::invalid_argument(std::string("FP8RL_FAULT_NODE_ANSWER = '") + fault + "': not 'rename'");
  if (x.rollout_names.empty()) return x;
  msg::node_actors y = x;
  y.rollout_names[0] += "-renamed";
  return y;
}

msg::node_agent_actor::behavior_type node_agent(msg::node_agent_actor::stateful_pointer<agent_state> self) {
  agent_signal(true, false, "", self->address());
  self->attach_functor([] { agent_signal(false, true); });
  self->set_down_handler([self](caf::down_msg& dm) {  // the controller is gone: stop this node, and say so
    // a controller that exited and one that dropped this node after a stall read the same here
    agent_signal(false, false, "lost the controller (" + self->system().render(dm.reason) +
                                   ": it exited, or this node did not answer for middleman.connection-timeout, 4 s); "
                                   "stopped this node's actors");
    for (auto& a : node_actors_all(self->state.spawned)) self->send_exit(a, caf::exit_reason::user_shutdown);
    self->quit();
  });
  return {
      [self](msg::start_atom, msg::node_start& init, msg::controller_actor& controller) -> caf::result<msg::node_actors> {
        {
          std::lock_guard<std::mutex> g(g_mu);
          g_agent_asked = true;
        }
        self->monitor(controller);  // first: a start that fails leaves the node to the controller's stop, or its loss
        try {
          const run_config cfg = recipe_from_json(init.recipe_json);
          const topology t = topology_from_json(init.topology_json);
          if (!t.find(init.node)) throw std::invalid_argument("no node named '" + init.node + "' in the controller's topology");
          {
            std::lock_guard<std::mutex> g(g_mu);
            if (init.node != g_node_name)  // the controller reached another process than it meant
              throw std::invalid_argument("this process runs node '" + g_node_name + "', the controller asked for node '" +
                                          init.node + "' (host/port mix-up in the topology?)");
          }
          auto env = env_make(cfg, init.node, init.run_dir, init.init_dir, run_start{init.start_version, init.start_cursor}, init.run_id);
          // this host's engines and learners, before any is allocated
          if (const std::string need = host_memory_check(cfg, env->model, t, init.node, init.start_version); !need.empty())
            log_get("train")->info("{}", need);
          if (cfg.trace)
            trace_writer::process().open((fs::path(init.run_dir) / "traces" / (init.node + ".jsonl")).string(), init.node,
                                         uint64_t(cfg.trace_max_mb) << 20);
          const auto idx = index_nodes(t).at(init.node);
          self->state.spawned = spawn_node(self->system(), *t.find(init.node), env, idx.first_learner, learner_world(t), idx.first_rollout);
          {
            std::lock_guard<std::mutex> g(g_mu);
            g_controller = controller;
          }
          return node_answer(self->state.spawned);
        } catch (const std::exception& e) {
          return caf::make_error(caf::sec::invalid_argument, std::string("node agent: ") + e.what());
        }
      },
      [self](msg::stop_atom) {
        for (auto& a : node_actors_all(self->state.spawned)) self->send_exit(a, caf::exit_reason::user_shutdown);
        self->quit();
      },
  };
}

struct fp8rl_config : caf::actor_system_config {
  fp8rl_config() {
    msg::messages_register(*this);
    add_actor_type("node_agent", node_agent);
    set("middleman.heartbeat-interval", caf::timespan{std::chrono::seconds(1)});
    set("middleman.connection-timeout", caf::timespan{std::chrono::seconds(4)});
    set("scheduler.max-threads", size_t{8});
    // A shared queue with a condition variable: idle workers sleep. Work stealing's idle workers
    // poll (every 50 us for ~25 ms, then every 10 ms); with the rollout and learner each computing
    // on one of the cores, that polling took 30-50% off the learner step (bench-rl, staleness 1).
    set("scheduler.policy", caf::atom("sharing"));
    set("logger.console", caf::atom("none"));
  }
};

struct cli {
  std::string recipe, topology, node, run_dir;
  int64_t node_wait_s = 120;  // a node waits this long for its controller to connect, and then to start it
  bool resume = false, overwrite = false, dump = false;
  std::vector<std::string> overrides;
  caf::actor_system_config::string_list caf_args;
};

// CAF 0.17 takes any atom for these options and falls back to its default on an unknown one
// (--scheduler.policy=shareing ran work stealing): refuse it, naming the option and its values.
void caf_options_validate(const caf::actor_system_config& cfg) {
  const std::vector<std::string> verbosities = {"quiet", "error", "warning", "info", "debug", "trace"};
  const std::vector<std::pair<std::string, std::vector<std::string>>> allowed = {
      {"scheduler.policy", {"stealing", "sharing"}},
      {"logger.verbosity", verbosities},
      {"logger.file-verbosity", verbosities},
      {"logger.console-verbosity", verbosities},
      {"logger.console", {"none", "colored", "uncolored"}},
      {"middleman.network-backend", {"default", "asio"}}};
  for (const auto& [key, values] : allowed) {
    const auto v = caf::get_if<caf::atom_value>(&caf::content(cfg), key);
    if (!v) continue;  // not set: CAF's default
    const std::string got = caf::to_string(*v);
    if (std::find(values.begin(), values.end(), got) != values.end()) continue;
    std::string list;
    for (const auto& a : values) {
      if (!list.empty()) list += ", ";
      list += a;
    }
    throw std::invalid_argument("CAF option --" + key + "=" + got + ": must be one of " + list);
  }
}

// CAF's own options into cfg (CAF also reads ./caf-application.ini where one exists); an error
// names the option or that file (CAF's words were "parser_error(not_an_option, ({...}))").
void caf_options_parse(fp8rl_config& cfg, const std::vector<std::string>& args) {
  const caf::error err = cfg.parse(args);
  if (!err) return;
  auto why_of = [](const caf::error& e) {
    if (e.category() != caf::atom("parser")) return caf::actor_system_config::render(e);
    const auto code = static_cast<caf::pec>(e.code());
    return code == caf::pec::not_an_option ? std::string("no such option") : "cannot parse its value (" + caf::to_string(code) + ")";
  };
  for (const auto& a : args) {  // each alone, without the .ini (a bad one failed every option)
    fp8rl_config one;
    std::istringstream no_ini;
    if (const caf::error e = one.parse(std::vector<std::string>{a}, no_ini)) throw std::invalid_argument("CAF option " + a + ": " + why_of(e));
  }
  if (fs::exists("caf-application.ini"))
    throw std::invalid_argument(fs::absolute("caf-application.ini").string() + " (CAF reads it from the working directory): " +
                                caf::actor_system_config::render(err));
  throw std::invalid_argument("CAF options: " + caf::actor_system_config::render(err));
}

// --node-wait SECONDS: a whole number in [1, 86400]
int64_t node_wait_parse(const std::string& v) {
  int64_t n = 0;
  const auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), n);
  if (ec != std::errc{} || end != v.data() + v.size() || n < 1 || n > 86400)
    throw std::invalid_argument("option --node-wait: '" + v + "' is not a whole number of seconds in [1, 86400]");
  return n;
}

cli parse_cli(int argc, char** argv) {
  cli c;
  run_config probe;
  std::set<std::string> sections;
  for (const auto& k : recipe_keys(probe)) sections.insert(k.section);
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto value = [&](const std::string& flag) -> std::string {
      if (a.size() > flag.size() && a[flag.size()] == '=') return a.substr(flag.size() + 1);
      if (i + 1 >= argc) throw std::invalid_argument("option " + flag + " needs a value");
      return argv[++i];
    };
    auto is = [&](const std::string& flag) { return a == flag || a.rfind(flag + "=", 0) == 0; };
    auto once = [&](std::string& dst, const std::string& flag) {  // a second one silently replaced the first
      const std::string v = value(flag);
      if (!dst.empty()) throw std::invalid_argument("option " + flag + " given twice ('" + dst + "', '" + v + "')");
      dst = v;
    };
    if (is("--recipe") || is("--config-file")) once(c.recipe, is("--recipe") ? "--recipe" : "--config-file");
    else if (is("--topology")) once(c.topology, "--topology");
    else if (is("--node")) once(c.node, "--node");
    else if (is("--run-dir")) once(c.run_dir, "--run-dir");
    else if (is("--node-wait")) c.node_wait_s = node_wait_parse(value("--node-wait"));
    else if (a == "--resume") c.resume = true;
    else if (a == "--overwrite") c.overwrite = true;
    else if (a == "--dump-config") c.dump = true;
    else if (a.rfind("--", 0) == 0 && sections.count(a.substr(2, a.find('.') == std::string::npos ? 0 : a.find('.') - 2)))
      c.overrides.push_back(a);  // applied in order: a key given again overrides (common flags, then changes)
    else if (a.rfind("--scheduler.", 0) == 0 || a.rfind("--middleman.", 0) == 0 || a.rfind("--logger.", 0) == 0 ||
             a.rfind("--caf#", 0) == 0)
      c.caf_args.push_back(a);
    else if (a == "--help" || a == "-h") {
      std::printf("usage: fp8rl train [--recipe FILE] [--topology FILE] [--node NAME] [--node-wait S] [--run-dir DIR] [--resume|--overwrite]\n"
                  "                   [--dump-config] [--section.key=value ...] [--scheduler.*|--middleman.*|--logger.*|--caf#* ...]\n"
                  "--config-file FILE is --recipe FILE (CAF's name). --node NAME: the topology node this process runs\n"
                  "(default: the controller's; caf-run passes it). --node-wait S: a node other than the controller's exits 1\n"
                  "when its controller has not connected within S seconds (default 120; a long warm start or model load\n"
                  "comes first), or has not started it S seconds after connecting. CAF's own options pass through to CAF.\n"
                  "The run directory defaults to runs/NAME (run.name), or runs/NAME-2, -3, ... while that holds an earlier\n"
                  "run; --resume continues the newest of them (or --run-dir) with the settings it ran with (recipe.conf,\n"
                  "or RUN_DIR/resumes/recipe-stepN.conf of the part that made its checkpoint), then the options given\n"
                  "(a run stopped before its first checkpoint starts again from step 0); --overwrite replaces the earlier run in\n"
                  "runs/NAME itself, not the newest (or in --run-dir): its outputs are moved to RUN_DIR/.replaced/ and\n"
                  "deleted once the new run recorded its first step; a start failed or killed before that gets them back.\n"
                  "Progress (one line per step) and logs go to stderr; --run.log_level=warn keeps the warnings and\n"
                  "errors only, off silences them.\n"
                  "Ctrl-C, SIGTERM or SIGHUP: the run stops after the step in progress, checkpointed there (exit\n"
                  "128+signal); a second one stops at once. On a node of a caf-run group it stops the whole run.\n"
                  "--section.key=value overrides the recipe, in order (a key given again: the last value counts).\n"
                  "Every recipe key with its default: fp8rl train --dump-config (documented in configs/default.conf).\n");
      std::exit(0);
    } else {
      // "--run.steps 3": a recipe key takes its value after '=' (the 3 read as an option of its own)
      if (const std::string prev = i > 1 ? argv[i - 1] : ""; prev.rfind("--", 0) == 0 && prev.find('.') != std::string::npos &&
                                                                prev.find('=') == std::string::npos)
        throw std::invalid_argument("unknown option '" + a + "' after " + prev + ": --section.key options take their value after '=' (" +
                                    prev + "=" + a + ")");
      throw std::invalid_argument("unknown option '" + a + "' (see fp8rl train --help)");
    }
  }
  return c;
}

// The newest whole checkpoint directory in ck (step_<digits>; a step_N.tmp a cut save left is
// none), or "".
std::string newest_step_dir(const fs::path& ck) {
  std::error_code ec;
  std::string step;
  std::optional<uint64_t> newest;
  for (const auto& e : fs::directory_iterator(ck, ec)) {
    const std::string n = e.path().filename().string();
    if (const auto k = checkpoint_step_of(n); k && (!newest || *k > *newest)) newest = k, step = n;
  }
  return step;
}

// The checkpoint this run starts from: resume (latest), a HF model dir, or a fresh SFT warm start.
std::string prepare_init(const run_config& cfg, const std::string& run_dir, bool resume, run_start* start) {
  *start = run_start{};
  const fs::path ck = fs::path(run_dir) / "checkpoints";
  if (resume) {
    // a run stopped before its first checkpoint (a second Ctrl-C, a kill, a crash) starts again
    // from step 0 with its own settings; train_main takes the start the run had
    const std::string step = newest_step_dir(ck);
    if (!fs::exists(ck / "latest") && step.empty() && fs::exists(fs::path(run_dir) / "recipe.conf")) {
      start->restart = true;
      return "";
    }
    std::ifstream f(ck / "latest");
    std::string name, more;
    if (!(f >> name))
      throw std::invalid_argument(run_dir + ": --resume but no checkpoints/latest" +
                                  (step.empty() ? std::string() : " (yet " + (ck / step).string() + " is there: name the checkpoint to "
                                                                  "resume from in checkpoints/latest)"));
    if (f >> more)  // "step_2 junk" or two lines: the first word was taken
      throw std::invalid_argument((ck / "latest").string() + " holds more than one checkpoint name ('" + name + "', '" + more + "')");
    // a checkpoint of this run: a path there ("../../other/step_1") resumed another run's weights
    if (name.find('/') != std::string::npos || name == "." || name == "..")
      throw std::invalid_argument((ck / "latest").string() + " names '" + name + "', not a checkpoint directory of this run");
    const fs::path dir = ck / name;
    if (!fs::is_directory(dir))
      throw std::invalid_argument((ck / "latest").string() + " names '" + name + "', which is not a checkpoint directory in " +
                                  ck.string());
    const std::string sp = (dir / "state.json").string();
    const json state = models::json_file_read(sp);
    if (!state.is_object()) throw std::invalid_argument(sp + ": not a JSON object");
    auto unsigned_key = [&](const char* key, const char* what) {
      if (!state.contains(key) || !state[key].is_number_unsigned())
        throw std::invalid_argument(sp + ": key '" + key + "' must be " + what + " >= 0");
      return state[key].get<uint64_t>();
    };
    start->version = unsigned_key("weight_version", "a step number");
    if (name.rfind("step_", 0) == 0 && name != "step_" + std::to_string(start->version))
      throw std::invalid_argument(sp + ": weight_version " + std::to_string(start->version) + " contradicts its directory " + name);
    if (start->version > 0) start->prompt_cursor = unsigned_key("prompt_cursor", "a prompt index");
    return dir.string();
  }
  if (cfg.init != "tiny") return cfg.init;
  // built-in tiny model + SFT warm start on the task's demonstrations
  const auto task = models::task_spec_parse(cfg.task);
  if (!task.builtin) throw std::invalid_argument("model.init = tiny works with built-in tasks; give a model directory for '" + cfg.task + "'");
  auto tok = models::char_tokenizer_make(models::arithmetic_alphabet());
  models::checkpoint c;
  const models::model_config mc = builtin_model_config(cfg, *tok);
  c.params = models::model_params_init(mc, static_cast<uint64_t>(cfg.seed));
  models::sft_config sc;
  sc.steps = cfg.sft_steps;
  sc.batch = cfg.sft_batch;
  sc.opt.lr = static_cast<float>(cfg.sft_lr);
  sc.seed = static_cast<uint64_t>(cfg.seed);
  sc.policy = recipe_rl_config(cfg).train_policy;
  const auto data = models::task_load(task, false, cfg.train_size, static_cast<uint64_t>(cfg.seed));
  auto log = log_get("train");
  log->info("SFT warm start: {} steps on {}", sc.steps, cfg.task);
  models::sft_train(c.params, c.opt, data, *tok, sc, [&](int64_t s, double l) {
    stop_signals::interruption_point("during the SFT warm start; nothing was trained or saved");
    if ((s + 1) % 100 == 0 || s + 1 == sc.steps) log->info("sft step {}/{} loss {:.4f}", s + 1, sc.steps, l);
  });
  c.opt = models::adamw_state{};
  c.state_json = json{{"weight_version", 0}, {"phase", "sft"}}.dump();
  const fs::path dir = ck / "init";
  models::checkpoint_save(dir.string(), c,
                          [](const std::string& tmp) { models::char_tokenizer_save(tmp, models::arithmetic_alphabet()); });
  return dir.string();
}

// --resume: the run's own settings -- those of the part that made the checkpoint (resumed at the
// largest N below its step: RUN_DIR/resumes/recipe-stepN.conf, else recipe.conf; a part resumed at
// the checkpoint's own step made none, as a failed resume) -- then this command's --recipe and
// --section.key overrides (they were all there was: a resume without the first command's options
// was refused, or ran with other ones). A restart (no checkpoint) takes the newest part's
// settings: an earlier restart's recipe-step0.conf, else recipe.conf.
run_config resume_recipe(const cli& c, const std::string& run_dir, const run_start& start) {
  const uint64_t start_version = start.version;
  fs::path base = fs::path(run_dir) / "recipe.conf";
  // without it nothing says which task, model and seed the checkpoint's cursor and weights refer to
  if (!fs::exists(base))
    throw std::invalid_argument("--resume: " + base.string() + " is missing: the run's task, model and seed cannot be checked "
                                "(restore it, or start a new run with --model.init=<a checkpoint of this run>)");
  std::error_code ec;
  int64_t newest = -1;
  for (const auto& e : fs::directory_iterator(fs::path(run_dir) / "resumes", ec)) {
    const std::string f = e.path().filename().string();  // recipe-stepN.conf
    if (f.rfind("recipe-step", 0) != 0 || f.size() < 17 || f.substr(f.size() - 5) != ".conf") continue;
    const std::string digits = f.substr(11, f.size() - 16);
    if (digits.find_first_not_of("0123456789") != std::string::npos || digits.size() > 18) continue;
    const int64_t n = std::stoll(digits);
    if (n > newest && (static_cast<uint64_t>(n) < start_version || (start.restart && n == 0))) newest = n, base = e.path();
  }
  run_config cfg;
  recipe_load_file(cfg, base.string());
  if (!c.recipe.empty()) recipe_load_file(cfg, c.recipe);
  for (const auto& o : c.overrides) recipe_apply_cli(cfg, o);
  recipe_finalize(cfg, [](const std::string& m) { log_get("train")->info("{}", m); }, base.string());
  recipe_validate(cfg);
  return cfg;
}

// --resume continues the run its recipe.conf records. What identifies the run's data and model
// (task.*, model.*, run.seed, run.name) cannot change: the checkpoint's prompt cursor and weights
// refer to them (a resume with another task trained on it from the old task's cursor). Other
// changes (more steps, another learning rate or batch) are allowed and returned, one line each, to
// be logged and recorded in resumes/ beside recipe.conf, which keeps the first part's settings.
std::string resume_recipe_changes(const run_config& cfg, const std::string& run_dir) {
  const fs::path stored = fs::path(run_dir) / "recipe.conf";  // resume_recipe checked it is there
  run_config was;
  recipe_load_file(was, stored.string());
  std::stringstream a(recipe_dump(was)), b(recipe_dump(cfg));  // one template: the lines align
  std::string la, lb, section, refused, changed;
  while (std::getline(a, la) && std::getline(b, lb)) {
    if (!la.empty() && la[0] == '[') section = la.substr(1, la.find(']') - 1);
    if (la == lb || la.empty() || la[0] == ';' || la.find('=') == std::string::npos) continue;
    const std::string key = section + "." + la.substr(0, la.find('='));
    const std::string line = "\n  " + key + ": " + la.substr(la.find('=') + 1) + " -> " + lb.substr(lb.find('=') + 1);
    (section == "task" || section == "model" || key == "run.seed" || key == "run.name" ? refused : changed) += line;
  }
  if (!refused.empty())
    throw std::invalid_argument("--resume: " + stored.string() + " records another task, model, seed or run name (give the run's own):" +
                                refused);
  return changed;
}

int run_remote_node(fp8rl_config& cfg, const topology& t, const std::string& name, int64_t wait_s) {
  const node_spec* n = t.find(name);
  {
    std::lock_guard<std::mutex> g(g_mu);
    g_node_name = name;
  }
  std::string failure;
  int stop_sent = 0;  // the signal whose stop this node asked the controller for
  {
    caf::actor_system sys{cfg};
    auto port = sys.middleman().open(static_cast<uint16_t>(n->port), n->host.c_str(), true);
    if (!port) {
      std::fprintf(stderr, "fp8rl node %s: cannot open port %ld on %s: %s%s\n", name.c_str(), long(n->port), n->host.c_str(),
                   sys.render(port.error()).c_str(), port_in_use(static_cast<uint16_t>(n->port)) ?
                   " -- the port is in use (another run or program listens there): free it, or give the node another port in the topology" : "");
      return 1;
    }
    std::fprintf(stdout, "fp8rl node %s ready on %s:%u\n", name.c_str(), n->host.c_str(), *port);
    std::fflush(stdout);
    std::unique_lock<std::mutex> lk(g_mu);
    const auto wait = std::chrono::seconds(wait_s);
    const auto deadline = std::chrono::steady_clock::now() + wait;
    std::optional<std::chrono::steady_clock::time_point> spawned_at;  // when this loop saw the agent
    while (!g_cv.wait_for(lk, std::chrono::milliseconds(100), [] { return g_agent_done; })) {
      const int sig = stop_signals::pending();
      // no controller to ask (none connected, or it never started this node's actors): the signal's
      // own action -- an agent spawned meanwhile would keep the actor system up
      if (sig && !g_controller) {
        std::fprintf(stderr, "fp8rl node %s: %s before the controller started this node's actors\n", name.c_str(),
                     stop_signals::name(sig).c_str());
        stop_signals::die(sig);
      }
      const auto now = std::chrono::steady_clock::now();
      if (!g_agent_started && now > deadline) {
        std::fprintf(stderr, "fp8rl node %s: no controller connected within %ld s (--node-wait)\n", name.c_str(), long(wait_s));
        return 1;
      }
      if (g_agent_started && !spawned_at) spawned_at = now;
      // a controller that spawned the agent and died before its start: nothing monitored it yet
      if (spawned_at && !g_agent_asked && now > *spawned_at + wait) {
        // a stop, not an exit: handled after a start already queued, it stops what that spawned (the
        // actor system waits for every actor)
        caf::anon_send(caf::actor_cast<msg::node_agent_actor>(g_agent), msg::stop_atom::value);
        g_agent = caf::actor_addr{};
        std::fprintf(stderr, "fp8rl node %s: the controller connected and did not start this node within %ld s (it exited "
                     "or stalled; --node-wait)\n", name.c_str(), long(wait_s));
        return 1;
      }
      if (sig && !stop_sent) {  // the run stops as a whole: the controller decides at which step
        stop_sent = sig;
        caf::anon_send(g_controller, msg::stop_atom::value, "node '" + name + "' got " + stop_signals::name(sig), int32_t{128 + sig});
        std::fprintf(stderr, "fp8rl node %s: %s: asked the controller to stop the run\n", name.c_str(), stop_signals::name(sig).c_str());
      }
    }
    failure = g_agent_failure;
    if (!stop_sent) stop_sent = stop_signals::pending();  // a signal the controller's end overtook: still this node's code
    if (failure.empty() && stop_sent) failure = "stopped by " + stop_signals::name(stop_sent) + " (the controller ended the run)";
    g_controller = msg::controller_actor{};  // not past its actor system
    g_agent = caf::actor_addr{};
  }  // the actor system is gone: its actors (exited asynchronously) emit no more trace events
  trace_writer::process().close();
  if (!failure.empty()) {  // it exited 0 in silence
    std::fprintf(stderr, "fp8rl node %s: %s\n", name.c_str(), failure.c_str());
    return stop_sent ? 128 + stop_sent : 1;  // signalled: 128 + its signal, as the controller's process
  }
  return 0;
}

// --dump-config: the effective recipe (a resume's: the run's own settings, then the options
// given) and the topology's placement plan.
int train_dump_config(const cli& c, run_config cfg, const topology& topo) {
  if (c.resume) {
    const std::string dir = run_dir_choose(c.run_dir, cfg.name, true, false);
    run_start at;
    prepare_init(cfg, dir, true, &at);
    cfg = resume_recipe(c, dir, at);
  }
  std::printf("%s\n; topology: %s\n", recipe_dump(cfg).c_str(), topo.source.c_str());
  for (const auto& p : topology_plan(topo))
    std::printf(";   %-12s on %-10s %s\n", p.actor.c_str(), p.node.c_str(), p.device.c_str());
  return 0;
}

void learning_problems_warn(const run_config& r) {
  for (const auto& p : recipe_learning_problems(r)) log_get("train")->warn("{}", p);
}

// What the SFT warm start (seconds to minutes) would only be followed by a refusal of, checked
// before it and before anything is written: every node's devices, this node's tile GEMMs, the
// built-in task against the built-in model; settings that cannot learn are warned of.
void train_precheck(const cli& c, const run_config& cfg, const topology& topo, const std::string& node) {
  const node_spec& here = *topo.find(node);
  if (!c.resume && here.has("controller")) learning_problems_warn(cfg);  // a resume warns with its own settings
  if (!c.resume && cfg.init != "tiny") {  // before a run directory is chosen (it said "this run writes runs/x-3", then failed)
    try {
      models::model_dir_check(cfg.init);
    } catch (const std::invalid_argument& e) {
      throw std::invalid_argument(std::string("model.init: ") + e.what());
    }
  }
  for (const auto& n : topo.nodes)
    for (const auto* devs : {&n.learners, &n.rollouts})
      for (const auto& d : *devs)
        if (const std::string why = device_problem(d); !why.empty())
          throw std::invalid_argument(topo.source + ": node '" + n.name + "': " + why);
  for (const auto* devs : {&here.learners, &here.rollouts})
    for (const auto& d : *devs)
      if (const std::string why = device_capacity_problem(d); !why.empty())
        throw std::invalid_argument(topo.source + ": node '" + here.name + "': " + why);
  const bool warm_start = here.has("controller") && !c.resume && cfg.init == "tiny";
  if (const std::string why = node_tiles_problem(cfg, here, warm_start); !why.empty()) throw std::invalid_argument(why);
  if (!c.resume && cfg.init == "tiny" && models::task_spec_parse(cfg.task).builtin) warm_start_check(cfg, topo, node);
}

// CAF's options (--caf#*, --logger.*, --scheduler.*, --middleman.*) and a worker per learner and rollout
// (topology.hpp). Detached actors, a thread each, would need no count, but CAF 0.17's shutdown
// waits for them to be destroyed while another node's proxies still hold them: a two-process run
// hung at its exit.
void caf_config_prepare(fp8rl_config& ccfg, const cli& c, const node_spec& here) {
  caf_options_parse(ccfg, c.caf_args);
  caf_options_validate(ccfg);
  const bool workers_given = std::any_of(c.caf_args.begin(), c.caf_args.end(), [](const std::string& a) {
    return a.rfind("--scheduler.max-threads", 0) == 0;
  });
  ccfg.set("scheduler.max-threads", node_scheduler_threads(here, caf::get_or(ccfg, "scheduler.max-threads", size_t{8}),
                                                           workers_given ? workers_from::user : workers_from::default_value));
  ccfg.load<caf::io::middleman>();
}

// The settings a run starts with, once it can start: a fresh run's recipe.conf; a resumed part's
// resumes/recipe-stepN.conf beside it (the next --resume starts from them; one failed here
// before is replaced), and a line saying which settings changed.
void recipe_record(const run_config& cfg, const std::string& run_dir, bool resume, const run_start& start,
                   const std::string& resumed_with) {
  auto write = [&](const fs::path& p) {  // checked: a recipe cut by a full disk failed only the run's --resume
    models::file_write_checked(p.string(), recipe_dump(cfg));
  };
  if (!resume) return write(fs::path(run_dir) / "recipe.conf");  // a resume has one (resume_recipe_changes refuses it otherwise)
  const fs::path f = fs::path(run_dir) / "resumes" / ("recipe-step" + std::to_string(start.version) + ".conf");
  fs::create_directories(f.parent_path());
  write(f);
  const char* what = start.restart ? "restarting" : "resuming";
  if (!resumed_with.empty())
    log_get("train")->warn("{} at step {} with other settings (recorded in {}):{}", what, start.version, f.string(), resumed_with);
  else
    log_get("train")->info("{} at step {} with the run's settings (recorded in {})", what, start.version, f.string());
}

// Where a topology runs learners and rollouts, node by node ("main: learners cpu:1 cpu:1, rollouts
// cpu:1"): what a resume compares (hosts and ports may change between parts).
std::string topology_placement(const topology& t) {
  std::string out;
  for (const auto& n : t.nodes) {
    if (!out.empty()) out += "; ";
    out.append(n.name).append(": learners");
    for (const auto& d : n.learners) out.append(" ").append(d.str());
    out += ", rollouts";
    for (const auto& d : n.rollouts) out.append(" ").append(d.str());
  }
  return out;
}

// RUN_DIR/topology.json: the topology of the run's latest part. A resume placed otherwise is said
// (a resume without --topology ran a two-learner run on the embedded one-learner default unsaid:
// the steps are sharded otherwise), then recorded.
void topology_record(const topology& t, const std::string& run_dir, bool resume) {
  const fs::path p = fs::path(run_dir) / "topology.json";
  if (resume && fs::exists(p)) {
    std::string was;
    try {
      was = topology_placement(topology_from_json(models::file_text_read(p.string())));
    } catch (const std::exception& e) {
      was = std::string("unreadable: ") + e.what();
    }
    if (const std::string now = topology_placement(t); was != now)
      log_get("train")->warn("resuming on another placement than the run's last part ({}): was {}; now {}, from {} "
                             "(--topology FILE runs it as before)", p.string(), was, now, t.source);
  }
  models::file_replace_durably(p.string(), topology_to_json(t) + "\n", "");
}

}  // namespace

caf::expected<caf::node_id> node_connect(caf::actor_system& sys, const std::string& host, uint16_t port, caf::timespan timeout) {
  caf::expected<caf::node_id> out{caf::sec::cannot_connect_to_node};
  caf::scoped_actor self{sys};
  self->request(sys.middleman().actor_handle(), timeout, caf::connect_atom_v, host, port)
      .receive(
          [&](caf::node_id& nid, caf::strong_actor_ptr&, std::set<std::string>&) {
            if (nid == caf::none) out = caf::make_error(caf::sec::invalid_argument, "no node id from " + host);  // as middleman::connect
            else out = std::move(nid);
          },
          [&](caf::error& e) { out = std::move(e); });
  return out;
}

namespace {

// Connects to every node but the controller's, spawns its agent and has it start the node's
// actors (init: what each is sent, but its name); appends to spawned, agents and agent_nodes.
// Returns "" or why a node could not be started (the caller stops what was started).
constexpr int kNodeConnectSeconds = 30;  // how long the controller tries to reach each remote node

std::string nodes_start_remote(caf::actor_system& sys, const topology& topo, msg::node_start init,
                               const msg::controller_actor& ctrl,
                               std::vector<std::pair<const node_spec*, msg::node_actors>>& spawned,
                               std::vector<caf::actor>& agents, std::vector<std::string>& agent_nodes) {
  const auto idx = index_nodes(topo);
  std::string failure;
  for (const auto& n : topo.nodes) {
    if (n.has("controller")) continue;
    caf::expected<caf::node_id> nid = caf::sec::cannot_connect_to_node;
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(kNodeConnectSeconds);
    while (!nid && std::chrono::steady_clock::now() < deadline) {  // the node may still be starting
      nid = node_connect(sys, n.host, static_cast<uint16_t>(n.port), std::chrono::seconds(5));
      if (!nid) std::this_thread::sleep_for(std::chrono::milliseconds(500));
    }
    if (!nid) {  // a node that died after opening its port looks the same from here
      failure = "cannot connect to node '" + n.name + "' at " + n.host + ":" + std::to_string(n.port) + " within " +
                std::to_string(kNodeConnectSeconds) + " s (" + sys.render(nid.error()) +
                "; is its process running? under caf-run, its lines say whether it exited)";
      break;
    }
    auto agent = sys.middleman().remote_spawn<msg::node_agent_actor>(*nid, "node_agent", caf::make_message(), std::chrono::seconds(30));
    if (!agent) {  // an fp8rl build with another node protocol fails CAF's interface check here
      failure = "remote spawn on '" + n.name + "': " + sys.render(agent.error()) + " (the same fp8rl build there?)";
      break;
    }
    agents.push_back(caf::actor_cast<caf::actor>(*agent));
    agent_nodes.push_back(n.name);
    init.node = n.name;
    caf::scoped_actor self{sys};
    self->request(*agent, std::chrono::seconds(120), msg::start_atom::value, init, ctrl)
        .receive(
            [&](msg::node_actors& x) {
              if (const std::string why = node_actors_problem(n, x, idx.at(n.name).first_rollout); !why.empty())
                failure = "node '" + n.name + "' started other actors than its topology entry names: " + why +
                          " (another fp8rl build there?)";
              spawned.emplace_back(&n, std::move(x));
            },
            [&](caf::error& err) { failure = "node '" + n.name + "' could not start its actors: " + sys.render(err); });
    if (!failure.empty()) break;
  }
  return failure;
}

// The wiring every actor is told: each singleton role from the one node that runs it
// (topology_load), the learners and rollouts in node order.
msg::peers_msg peers_merge(const msg::controller_actor& ctrl,
                           const std::vector<std::pair<const node_spec*, msg::node_actors>>& spawned) {
  msg::peers_msg peers;
  peers.controller = ctrl;
  for (const auto& [n, x] : spawned) {
    if (x.buffer) peers.buffer = x.buffer;
    if (x.reward) peers.reward = x.reward;
    if (x.weight_sync) peers.weight_sync = x.weight_sync;
    if (x.calibration) peers.calibration = x.calibration;
    peers.learners.insert(peers.learners.end(), x.learners.begin(), x.learners.end());
    peers.rollouts.insert(peers.rollouts.end(), x.rollouts.begin(), x.rollouts.end());
    peers.rollout_names.insert(peers.rollout_names.end(), x.rollout_names.begin(), x.rollout_names.end());
  }
  return peers;
}

}  // namespace

int train_main(int argc, char** argv) {
  const cli c = parse_cli(argc, argv);
  run_config cfg;
  if (!c.recipe.empty()) recipe_load_file(cfg, c.recipe);
  for (const auto& o : c.overrides) recipe_apply_cli(cfg, o);
  recipe_finalize(cfg, [](const std::string& m) { log_get("train")->info("{}", m); });
  recipe_validate(cfg);
  topology topo = c.topology.empty() ? topology_local(1, 1) : topology_load(c.topology);
  if (c.dump) return train_dump_config(c, cfg, topo);
  const std::string node = c.node.empty() ? topo.controller_node().name : c.node;
  if (!topo.find(node)) {
    std::string names;
    for (const auto& n : topo.nodes) names += (names.empty() ? "" : ", ") + n.name;
    throw std::invalid_argument(topo.source + ": no node named '" + node + "' (its nodes: " + names + ")");
  }
  const node_spec& here = *topo.find(node);
  train_precheck(c, cfg, topo, node);
  fp8rl_config ccfg;
  caf_config_prepare(ccfg, c, here);
  const stop_signals signals;  // from here on a signal stops the start or the run (signals.hpp)
  if (!here.has("controller")) return run_remote_node(ccfg, topo, node, c.node_wait_s);
  if (c.node.empty() && topo.nodes.size() > 1)  // caf-run passes --node: started by hand, the other nodes are the user's to start
    log_get("train")->warn("{}: this process runs node '{}'; its other {} node(s) must be started too (caf-run starts "
                           "them all; by hand: fp8rl train --topology {} --node NAME): it waits {} s for them after the start",
                           topo.source, node, topo.nodes.size() - 1, topo.source, kNodeConnectSeconds);

  const std::string run_dir = run_dir_choose(c.run_dir, cfg.name, c.resume, c.overwrite, cfg.init == "tiny" ? "" : cfg.init);
  if (c.run_dir.empty() && !c.resume && run_dir != "runs/" + cfg.name)
    log_get("train")->info("runs/{} holds an earlier run; this run writes {}", cfg.name, run_dir);
  // a start refused before it wrote anything leaves no empty run directory behind
  struct remove_if_left_empty {
    fs::path dir;
    bool armed;
    ~remove_if_left_empty() {
      std::error_code ec;
      if (armed && fs::is_empty(dir, ec)) fs::remove(dir, ec);
    }
  } created{run_dir, !fs::exists(run_dir)};
  fs::create_directories(run_dir);
  // --overwrite: the earlier run is moved aside and deleted only once this one has recorded a step
  std::optional<run_dir_stash> replaced;
  if (c.overwrite && !run_dir_outputs(run_dir).empty()) replaced.emplace(run_dir);
  run_start start;
  std::string init_dir, resumed_with;
  if (c.resume) {  // the checkpoint's step first: it picks the settings of the part that made it
    init_dir = prepare_init(cfg, run_dir, true, &start);
    cfg = resume_recipe(c, run_dir, start);
    resumed_with = resume_recipe_changes(cfg, run_dir);
    learning_problems_warn(cfg);
    if (start.restart) {  // the run's own start: its warm start (written before recipe.conf; done
      // again, the same for the seed, where it is gone) or model
      init_dir = cfg.init == "tiny" ? (fs::path(run_dir) / "checkpoints" / "init").string() : cfg.init;
      log_get("train")->warn("{} has no checkpoint (stopped before its first): the run starts again from step 0 ({})", run_dir,
                             init_dir);
    }
    const bool warm = start.restart && cfg.init == "tiny" && !fs::exists(fs::path(init_dir) / "config.json");
    if (const std::string why = node_tiles_problem(cfg, here, warm); !why.empty()) throw std::invalid_argument(why);
    if (warm) {  // what a fresh start checks before its warm start
      warm_start_check(cfg, topo, node);
      init_dir = prepare_init(cfg, run_dir, false, &start);
      start.restart = true;
    }
  } else {
    init_dir = prepare_init(cfg, run_dir, false, &start);
  }
  const uint64_t start_version = start.version;
  if (start_version >= static_cast<uint64_t>(cfg.steps)) {
    std::fprintf(stderr, "fp8rl train: %s is already at step %lu of %ld\n", run_dir.c_str(),
                 static_cast<unsigned long>(start_version), long(cfg.steps));
    return 0;
  }
  const std::string run_id = cfg.name + "-" + std::to_string(trace_now_us()) + "-" + std::to_string(::getpid());
  auto env = env_make(cfg, node, run_dir, init_dir, start, run_id);
  if (const std::string need = host_memory_check(cfg, env->model, topo, node, start_version); !need.empty())
    log_get("train")->info("{}", need);
  run_preflight(*env, c.resume, start.restart);  // every file the actors will read or write, before any of them starts
  // a signal now gives the start up (before recipe.conf marks a run); later, the run starts and
  // stops at its first step. An --overwrite's earlier run is deleted once the new run has recorded
  // a step (the controller's on_first_step): one failing at its first step gives it back.
  if (replaced) run_dir_stash::interruption_point();
  else stop_signals::interruption_point("before the run started; nothing was trained");
  created.armed = false;
  recipe_record(cfg, run_dir, c.resume, start, resumed_with);
  topology_record(topo, run_dir, c.resume);
  if (cfg.trace)
    trace_writer::process().open((fs::path(run_dir) / "traces" / (node + ".jsonl")).string(), node, uint64_t(cfg.trace_max_mb) << 20);
  int code = 1;
  stop_signals::immediate(true);  // until the actors are wired (signals.hpp); one pending already is sent after
  if (replaced) replaced->run_started();
  {
    caf::actor_system sys{ccfg};
    std::promise<int> done;
    auto fut = done.get_future();
    auto once = std::make_shared<std::once_flag>();
    controller_options opts;
    opts.on_done = [&done, once](int rc) { std::call_once(*once, [&] { done.set_value(rc); }); };
    if (replaced) opts.on_first_step = [&replaced] { replaced->drop_now(); };
    const auto idx = index_nodes(topo);
    std::map<std::string, device_spec> local_rollouts;  // what the controller can restart: this process's
    for (size_t i = 0; i < topo.controller_node().rollouts.size(); ++i)
      local_rollouts[rollout_name(idx.at(node).first_rollout + static_cast<int64_t>(i))] = topo.controller_node().rollouts[i];
    opts.respawn_rollout = [env, local_rollouts](caf::actor_system& s, const std::string& name) {
      auto it = local_rollouts.find(name);
      return it == local_rollouts.end() ? msg::rollout_actor{} : spawn_rollout(s, env, name, it->second);
    };
    auto ctrl = spawn_controller(sys, env, opts);
    const int32_t world = learner_world(topo);
    std::vector<std::pair<const node_spec*, msg::node_actors>> spawned;
    spawned.emplace_back(&topo.controller_node(), spawn_node(sys, topo.controller_node(), env, idx.at(node).first_learner, world,
                                                             idx.at(node).first_rollout));
    std::vector<caf::actor> agents;
    std::vector<std::string> agent_nodes;  // their topology names: the controller names a lost node by them
    msg::node_start init;  // what every remote node is sent (but its name)
    init.recipe_json = recipe_to_json(cfg);
    init.topology_json = topology_to_json(topo);
    init.run_dir = fs::absolute(run_dir).string();
    init.init_dir = fs::absolute(init_dir).string();
    init.run_id = run_id;
    init.start_version = start.version;
    init.start_cursor = start.prompt_cursor;
    // a controller that failed while starting (named in its log) needs no nodes started for it
    const bool ctrl_failed = fut.wait_for(std::chrono::seconds(0)) == std::future_status::ready;
    const std::string failure = ctrl_failed ? "" : nodes_start_remote(sys, topo, init, ctrl, spawned, agents, agent_nodes);
    if (ctrl_failed) {
      code = fut.get();
    } else if (failure.empty()) {
      caf::anon_send(ctrl, peers_merge(ctrl, spawned), agents, std::move(agent_nodes));
      stop_signals::immediate(false);
      for (bool stop_sent = false; fut.wait_for(std::chrono::milliseconds(100)) != std::future_status::ready;)
        if (const int sig = stop_signals::pending(); sig && !stop_sent) {  // the controller stops the run at a step
          stop_sent = true;
          caf::anon_send(ctrl, msg::stop_atom::value, stop_signals::name(sig), int32_t{128 + sig});
        }
      code = fut.get();
    } else {
      std::fprintf(stderr, "fp8rl train: %s\n", failure.c_str());
      caf::anon_send_exit(ctrl, caf::exit_reason::user_shutdown);
      code = 1;
    }
    // every actor and node agent stopped: the controller stops those it was told of, and one that
    // failed before its wiring (or a start that failed) told none -- the actor system waited for them
    for (auto& [n, x] : spawned) for (auto& a : node_actors_all(x)) caf::anon_send_exit(a, caf::exit_reason::user_shutdown);
    for (auto& a : agents) caf::anon_send(caf::actor_cast<msg::node_agent_actor>(a), msg::stop_atom::value);
  }
  trace_writer::process().close();
  return code;
}

}  // namespace fp8rl::actors
