"""IceCache and IceCache-reuse as registered methods: the checks of their settings, the budget's pages, and which
layer owns the index and selection a layer uses."""

from __future__ import annotations

from icecache.core.method import METHODS, Method, SequenceContext, SpeedGoal, prompt_offload_goals
from icecache.dci.index import SCORE_PRECISIONS
from icecache.errors import ConfigError

from .config import CPU_KV_DTYPES, DCI_LEAF_CAPACITY, IceCacheConfig, IceCacheReuseConfig
from .layer import IceCacheLayer


@METHODS.register("icecache")
class IceCache(Method):
    display_name = "IceCache"
    display_order = 120
    paper_names = ("Ice",)
    config_class = IceCacheConfig
    traces_in_graph = True
    # 64 tokens are 4 pages: 1 sink + 2 selected + 1 window.
    test_settings = {"n_sink_pages": 1, "n_window_pages": 1}
    variants = {"lookahead": {"lookahead": True}}
    # The floor of the design: 30 index searches a step (0.73 ms a layer at 32k on 16 threads), the transformer's
    # own step and ~1 MB of pages a layer, about 31 ms at 32k beside full_static's 8.8 on an H200.
    speed_goals = (
        SpeedGoal(32768, "tpot", 3.5, "its design's floor"),
        SpeedGoal(131072, "tpot", 8.0, "its design's floor"),
        SpeedGoal(32768, "tpot", 3.0, "its design's floor, the search under the previous layer's GPU work",
                  settings="lookahead=true"),
        *prompt_offload_goals("the prompt's index built beside the prefill"),
    )

    def forced_positions(self, n_tokens):
        # The sink pages, and the window, which always holds its n_window_pages - 1 full pages and one more token.
        cfg = self.config
        n_window = (cfg.n_window_pages - 1) * cfg.page_size + 1
        sinks = list(range(min(cfg.n_sink_pages * cfg.page_size, n_tokens)))
        return sinks + list(range(max(0, n_tokens - n_window), n_tokens))

    @property
    def page_budget(self) -> int:
        return self.config.page_budget

    @property
    def gpu_tokens(self) -> int:
        return self.config.gpu_tokens

    @property
    def n_selected_pages(self) -> int:
        return self.config.n_selected_pages

    def check(self) -> None:
        super().check()
        cfg = self.config
        if cfg.page_size != DCI_LEAF_CAPACITY:
            raise ConfigError(
                f"icecache page_size must be {DCI_LEAF_CAPACITY} (the DCI leaf capacity), not {cfg.page_size}")
        if cfg.n_sink_pages < 0 or cfg.n_window_pages < 1:
            raise ConfigError("icecache needs n_sink_pages >= 0 and n_window_pages >= 1")
        cfg.check_pages()
        if cfg.n_reuse_layers < 1:
            raise ConfigError("n_reuse_layers must be >= 1 (1 = no reuse)")
        if cfg.prompt_workers < 1 or (cfg.build_threads is not None and cfg.build_threads < 1):
            raise ConfigError("icecache needs prompt_workers >= 1 and build_threads >= 1 (or null)")
        if cfg.dci_score_precision not in SCORE_PRECISIONS:
            raise ConfigError(
                f"dci_score_precision={cfg.dci_score_precision}: use one of {', '.join(SCORE_PRECISIONS)}")
        if not -1.0 <= cfg.lookahead_min_cosine <= 1.0:
            raise ConfigError(f"lookahead_min_cosine={cfg.lookahead_min_cosine} is a cosine: use a value in [-1, 1]")
        if cfg.search_team_spin_us is not None and (isinstance(cfg.search_team_spin_us, bool)
                                                    or not isinstance(cfg.search_team_spin_us, int)
                                                    or cfg.search_team_spin_us < 0):
            raise ConfigError(f"search_team_spin_us={cfg.search_team_spin_us!r}: use microseconds >= 0, or null")
        if cfg.cpu_kv_dtype != "auto" and cfg.cpu_kv_dtype not in CPU_KV_DTYPES:
            raise ConfigError(f"cpu_kv_dtype={cfg.cpu_kv_dtype}: use auto, {', '.join(CPU_KV_DTYPES)}")

    @property
    def index_threads(self) -> int:
        return self.config.index_threads

    def owner_of(self, layer_idx: int) -> int:
        return self.config.owner_of(layer_idx)

    @property
    def captures_decode_step(self) -> bool:
        # The host step writes into the Triton kernels' fixed buffers; without Triton the step runs eagerly.
        from icecache.core.kernels import triton_runtime

        return super().captures_decode_step and triton_runtime.available()

    def make_sparse_layer(self, layer_idx: int, seq: SequenceContext):
        return IceCacheLayer(layer_idx, self.model, seq, self.config)


@METHODS.register("icecache_reuse")
class IceCacheReuse(IceCache):
    """IceCache(r): one index and selection per group of ``n_reuse_layers`` consecutive layers (default 3)."""

    display_name = "IceCache(r)"
    display_order = 121
    paper_names = ("Ice(r)",)
    config_class = IceCacheReuseConfig
    speed_goals = (
        SpeedGoal(32768, "tpot", 2.0, "its design's floor: a third of IceCache's searches"),
        SpeedGoal(131072, "tpot", 4.0, "its design's floor: a third of IceCache's searches"),
        *prompt_offload_goals("the prompt's index built beside the prefill"),
    )
