from django.urls import path

from routing.gateway import views

urlpatterns = [
    path("v1/chat/completions", views.chat_completions, name="chat-completions"),
    path("v1/completions", views.completions, name="completions"),
    path("v1/models", views.models, name="models"),
]
