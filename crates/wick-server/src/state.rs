//! [`AppState`]: what every handler shares — the engine handle, the model, the settings, the
//! chat template in force, the tool-call format and the metrics. One `Clone` struct of `Arc`s.
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use wick_chat::chat_template::{ChatTemplate, TemplateCapabilities, TemplateTokens};
use wick_chat::tool_call::ToolFormat;
use wick_engine::adapters::AdapterRegistry;
use wick_engine::scheduler::EngineHandle;
use wick_engine::{EngineError, Model};

use crate::config::ServerConfig;
use crate::error::StartupError;
use crate::jobs::Jobs;
use crate::metrics::Metrics;
use crate::response_store::ResponseStore;

/// Shared server state.
#[derive(Clone)]
pub struct AppState {
    engine: EngineHandle,
    config: Arc<ServerConfig>,
    template: Option<Arc<ChatTemplate>>,
    tool_format: ToolFormat,
    metrics: Arc<Metrics>,
    responses: Arc<ResponseStore>,
    started: Arc<Started>,
    adapters: Arc<AdapterRegistry>,
    jobs: Arc<Result<Arc<Jobs>, String>>,
}

/// When the server started.
#[derive(Debug)]
struct Started {
    unix: u64,
    instant: Instant,
}

impl AppState {
    /// State for serving `engine`'s model with `config`: compiles a `--chat-template`
    /// override and picks the tool-call format (`--tool-parser`, else detected from the chat
    /// template and architecture, else Hermes JSON).
    pub fn new(engine: EngineHandle, config: ServerConfig) -> Result<AppState, StartupError> {
        let model = engine.model().clone();
        let template = match &config.chat_template {
            Some((name, source)) => {
                let tokens = TemplateTokens {
                    bos_token: model.tokenizer().bos_token().map(str::to_string),
                    eos_token: model.tokenizer().eos_token().map(str::to_string),
                    ..TemplateTokens::default()
                };
                let compiled =
                    ChatTemplate::new(source, tokens).map_err(|e| StartupError::ChatTemplate {
                        source_name: name.clone(),
                        reason: e.to_string(),
                    })?;
                Some(Arc::new(compiled))
            }
            None => None,
        };
        let template_source = config
            .chat_template
            .as_ref()
            .map(|(_, s)| s.as_str())
            .or(model.chat_template_source())
            .unwrap_or("");
        let arch = model.info().arch.to_string();
        let tool_format = match config.tool_format {
            Some(format) => format,
            None => ToolFormat::detect(template_source, &arch).unwrap_or_else(|| {
                tracing::info!(
                    arch = %arch,
                    "no tool-call format detected from the chat template; using hermes-json"
                );
                ToolFormat::HermesJson
            }),
        };
        let adapters = Arc::new(AdapterRegistry::default());
        for (i, dir) in config.adapters.iter().enumerate() {
            let id = wick_engine::adapters::default_id(dir);
            let adapter = model.load_adapter(&id, dir)?;
            tracing::info!(
                id = %id,
                path = %dir.display(),
                rank = adapter.info().rank,
                layers = adapter.info().mounted_layers,
                "adapter mounted"
            );
            adapters
                .insert(Arc::new(adapter))
                .map_err(EngineError::from)?;
            if i == 0 {
                adapters.set_default(&id).map_err(EngineError::from)?;
            }
        }
        let jobs = match &config.jobs {
            Some(cfg) => Jobs::open(cfg.clone()).inspect_err(|reason| {
                tracing::warn!(%reason, "training jobs are off");
            }),
            None => Err("this server was started without a job directory".to_string()),
        };
        let unix = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        Ok(AppState {
            engine,
            config: Arc::new(config),
            template,
            tool_format,
            metrics: Arc::new(Metrics::default()),
            responses: Arc::new(ResponseStore::default()),
            started: Arc::new(Started {
                unix,
                instant: Instant::now(),
            }),
            adapters,
            jobs: Arc::new(jobs),
        })
    }

    /// The training job system, or why there is none.
    pub fn jobs(&self) -> Result<&Arc<Jobs>, &str> {
        self.jobs.as_ref().as_ref().map_err(String::as_str)
    }

    /// The mounted LoRA adapters.
    pub fn adapters(&self) -> &AdapterRegistry {
        &self.adapters
    }

    /// The engine.
    pub fn engine(&self) -> &EngineHandle {
        &self.engine
    }

    /// The served model.
    pub fn model(&self) -> &Arc<Model> {
        self.engine.model()
    }

    /// The settings.
    pub fn config(&self) -> &ServerConfig {
        &self.config
    }

    /// Whether `id` names the served model: its id, one of its aliases (what was typed on
    /// the command line) or its file name.
    pub fn answers_to(&self, id: &str) -> bool {
        id == self.config.model_id
            || self.config.model_aliases.iter().any(|a| a == id)
            || id == self.model().info().name
    }

    /// The `--chat-template` override, if any.
    pub fn template_override(&self) -> Option<&Arc<ChatTemplate>> {
        self.template.as_ref()
    }

    /// What the chat template in force supports (`None`: the model has no template).
    pub fn template_capabilities(&self) -> Option<TemplateCapabilities> {
        match &self.template {
            Some(t) => Some(t.capabilities()),
            None => self.model().chat_template().map(ChatTemplate::capabilities),
        }
    }

    /// The tool-call format in force.
    pub fn tool_format(&self) -> ToolFormat {
        self.tool_format
    }

    /// The metrics registry.
    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    /// Stored Responses-API responses.
    pub fn responses(&self) -> &ResponseStore {
        &self.responses
    }

    /// Unix time the server started.
    pub fn started_unix(&self) -> u64 {
        self.started.unix
    }

    /// Seconds since the server started.
    pub fn uptime_secs(&self) -> f64 {
        self.started.instant.elapsed().as_secs_f64()
    }
}
